"""Every registered annotation, for every splittable label, on a sample call: the parts run on
slices of random inputs and combined (concatenated, or summed for value splits) equal the whole
op, forward and gradients (float64, so a wrong scale cannot hide in rounding)."""

from __future__ import annotations

import pytest
import torch

from ssdsl.ops import (
    Annotation, FrozenDimError, IndivisibleError, NotAnnotated, UnknownDimError, annotate_call,
    registered,
)
from ssdsl.ops.elementwise import BINARY_DEFAULT, BINARY_TENSOR, IDENTITY, UNARY
from tests.test_ops_oracle import check_parts, equal_parts, make_call

D = torch.float64


def r(*shape, positive: bool = False, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    t = torch.randn(shape, generator=g, dtype=D)
    return t.abs() + 0.5 if positive else t


def ints(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(high))


# per row, three distinct columns of six
UNIQUE = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(k))[:3]
                      for k in range(4)])


def _elementwise_samples() -> dict[str, list]:
    s: dict[str, list] = {}
    for n in UNARY:
        x = r(4, 6, positive=n in ("log", "sqrt", "rsqrt", "log1p", "log2", "log10", "digamma",
                                   "lgamma"))
        if n in ("logical_not", "bitwise_not"):
            x = x > 0
        if n in ("asin", "acos", "atanh", "erfinv", "logit"):  # defined on (-1, 1) or (0, 1)
            x = torch.sigmoid(x) * (0.9 if n == "logit" else 1.8) - (0.0 if n == "logit" else 0.9)
        s[f"aten.{n}.default"] = [([x], {})]
    s["aten.threshold.default"] = [([r(4, 6), 0.1, -2.0], {})]
    s["aten.softshrink.default"] = [([r(4, 6), 0.3], {})]
    s["aten.celu.default"] = [([r(4, 6), 0.7], {})]
    s["aten.clamp.default"] = [([r(4, 6), -0.5, 0.5], {})]
    s["aten.clamp_min.default"] = [([r(4, 6), 0.0], {})]
    s["aten.clamp_max.default"] = [([r(4, 6), 0.0], {})]
    for n in IDENTITY:
        s[f"aten.{n}.default"] = [([r(4, 6)], {})]
    s["aten._to_copy.default"] = [([r(4, 6)], {"dtype": D})]
    s["aten.dropout.default"] = [([r(4, 6), 0.0, False], {})]
    for n in BINARY_TENSOR + BINARY_DEFAULT:
        a, b = r(4, 6, seed=1), r(6, seed=2, positive=True)
        c, d = r(4, 1, seed=3), r(1, 6, seed=4, positive=True)
        if n in ("bitwise_and", "bitwise_or", "logical_and", "logical_or"):
            a, b, c, d = a > 0, b > 1, c > 0, d > 1
        if n == "floor_divide":
            a, b, c, d = ints(9, 4, 6), ints(9, 6) + 1, ints(9, 4, 1), ints(9, 1, 6) + 1
        suffix = "Tensor" if n in BINARY_TENSOR else "default"
        s[f"aten.{n}.{suffix}"] = [([a, b], {}), ([c, d], {})]
    for n in ["add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "rsub",
              "remainder", "fmod"]:
        s[f"aten.{n}.Scalar"] = [([r(4, 6), 2.0], {})]
    s.update({
        "aten.pow.Tensor_Scalar": [([r(4, 6, positive=True), 2.5], {})],
        "aten.pow.Tensor_Tensor": [([r(4, 6, positive=True), r(6)], {})],
        "aten.pow.Scalar": [([2.0, r(4, 6)], {})],
        "aten.rsub.Tensor": [([r(4, 6), r(6)], {})],
        "aten.div.Tensor_mode": [([r(4, 6), r(6, positive=True)], {"rounding_mode": "floor"})],
        "aten.to.dtype": [([r(4, 6), torch.float32], {})],
        "aten.to.dtype_layout": [([r(4, 6)], {"dtype": D})],
        "aten.to.device": [([r(4, 6), torch.device("cpu"), D], {})],
        "aten.to.other": [([r(4, 6), r(2)], {})],
        "aten.type_as.default": [([r(4, 6), r(2)], {})],
        "aten.where.self": [([r(4, 6) > 0, r(4, 6, seed=1), r(6)], {})],
        "aten.broadcast_tensors.default": [([[r(4, 6), r(4, 6, seed=1)]], {}),
                                           ([[r(4, 1), r(1, 6, seed=1), r(6, seed=2)]], {})],
        "aten.where.ScalarSelf": [([r(4, 6) > 0, 1.0, r(4, 6)], {})],
        "aten.where.ScalarOther": [([r(4, 6) > 0, r(4, 6), 1.0], {})],
        "aten.masked_fill.Scalar": [([r(4, 6), r(1, 6) > 0, -1.0], {})],
        "aten.masked_fill.Tensor": [([r(4, 6), r(4, 1) > 0, torch.tensor(-2.0, dtype=D)], {})],
        "aten.clamp.Tensor": [([r(4, 6), r(6, seed=5) - 1, r(6, seed=6) + 1], {})],
        "aten.lerp.Scalar": [([r(4, 6), r(6), 0.3], {})],
        "aten.lerp.Tensor": [([r(4, 6), r(6), r(4, 1)], {})],
        "aten.addcmul.default": [([r(4, 6), r(6), r(4, 1)], {"value": 0.5})],
        "aten.addcdiv.default": [([r(4, 6), r(6), r(4, 1, positive=True)], {"value": 0.5})],
        "aten.fill.Scalar": [([r(4, 6), 3.0], {})],
        "aten.__and__.Tensor": [([r(4, 6) > 0, r(6) > 0], {})],
        "aten.__or__.Tensor": [([r(4, 6) > 0, r(4, 1) > 0], {})],
        "aten.__and__.Scalar": [([r(4, 6) > 0, True], {})],
        "aten.diff.default": [([r(4, 6), 1, -1], {}), ([r(4, 6), 1, 0, r(1, 6)], {})],
        "aten.zeros_like.default": [([r(4, 6)], {})],
        "aten.ones_like.default": [([r(4, 6)], {})],
        "aten.full_like.default": [([r(4, 6), 2.0], {})],
        "aten.lift_fresh_copy.default": [([r(4, 6)], {})],
        "aten.min.other": [([r(4, 6), r(6, seed=2)], {})],
        "aten.max.other": [([r(4, 6), r(4, 1, seed=2)], {})],
        "aten.scalar_tensor.default": [([2.5], {"dtype": D})],
        "aten.copy_.default": [([r(4, 6), r(6, seed=3)], {})],
        "aten.masked_fill_.Scalar": [([r(4, 6), r(4, 1) > 0, -1.0], {})],
        "aten.masked_fill_.Tensor": [([r(4, 6), r(6) > 0, torch.tensor(2.0, dtype=D)], {})],
        "aten.fill_.Scalar": [([r(4, 6), 3.0], {})],
        "aten.fill_.Tensor": [([r(4, 6), torch.tensor(3.0, dtype=D)], {})],
        "aten.zero_.default": [([r(4, 6)], {})],
        "aten.detach_.default": [([r(4, 6)], {})],
        "aten.clamp_.default": [([r(4, 6), -0.5, 0.5], {})],
        "aten.clamp_min_.default": [([r(4, 6), 0.0], {})],
        "aten.clamp_max_.default": [([r(4, 6), 0.0], {})],
    })
    for n in ["relu", "gelu", "silu", "sigmoid", "tanh", "exp", "neg", "sqrt", "rsqrt", "abs",
              "reciprocal", "hardswish", "hardsigmoid", "hardtanh", "mish"]:
        s[f"aten.{n}_.default"] = [([r(4, 6, positive=n in ("sqrt", "rsqrt"))], {})]
    for n in ["add", "sub", "mul", "div"]:
        s[f"aten.{n}_.Tensor"] = [([r(4, 6), r(6, seed=2, positive=True)], {}),
                                  ([r(4, 6), r(4, 1, seed=3, positive=True)], {})]
        s[f"aten.{n}_.Scalar"] = [([r(4, 6), 2.0], {})]
    return s


def _samples() -> dict[str, list]:
    s = _elementwise_samples()
    x = r(2, 4, 6)
    s.update({
        "aten.linear.default": [([r(2, 3, 8), r(6, 8), r(6)], {}), ([r(4, 8), r(6, 8)], {})],
        "aten.matmul.default": [([r(2, 3, 4, 8), r(2, 1, 8, 6)], {}), ([r(4, 8), r(8)], {})],
        "aten.mm.default": [([r(4, 8), r(8, 6)], {})],
        "aten.bmm.default": [([r(2, 4, 8), r(2, 8, 6)], {})],
        "aten.addmm.default": [([r(6), r(4, 8), r(8, 6)], {})],
        "aten.baddbmm.default": [([r(2, 4, 6), r(2, 4, 8), r(2, 8, 6)], {})],
        "aten.einsum.default": [(["bik,bkj->bij", [r(2, 4, 8), r(2, 8, 6)]], {}),
                                (["...ij,jk->...ik", [r(2, 4, 6), r(6, 4)]], {}),
                                (["bsid,bsje->bijde", [r(2, 4, 2, 2), r(2, 4, 4, 2)]], {})],
        "aten.view.default": [([x, [2, 4, 2, 3]], {}), ([x, [8, 6]], {}), ([x, [2, 24]], {})],
        "aten.reshape.default": [([x, [-1, 6]], {}), ([r(2, 6, 4), [2, 4, 6]], {})],
        "aten._unsafe_view.default": [([x, [2, 4, 3, 2]], {})],
        "aten.flatten.using_ints": [([x, 0, 1], {})],
        "aten.view_as.default": [([x, r(8, 6)], {}), ([r(8, 6), x], {})],
        "aten.reshape_as.default": [([x, r(2, 24)], {})],
        "aten.expand_as.default": [([r(2, 1, 6), x], {})],
        "aten.unflatten.int": [([x, 2, [2, 3]], {})],
        "aten.unsqueeze.default": [([x, 1], {})],
        "aten.squeeze.dim": [([r(2, 1, 6), 1], {})],
        "aten.squeeze.dims": [([r(2, 1, 6, 1), [1, 3]], {})],
        "aten.squeeze.default": [([r(2, 1, 6)], {})],
        "aten.permute.default": [([x, [2, 0, 1]], {})],
        "aten.transpose.int": [([x, 1, 2], {})],
        "aten.t.default": [([r(4, 6)], {})],
        "aten.numpy_T.default": [([r(4, 6)], {}), ([x], {})],
        "aten.mT.default": [([x], {})],
        "aten.adjoint.default": [([x], {})],
        "aten.matrix_H.default": [([r(4, 6)], {})],
        "aten.split.Tensor": [([r(2, 4, 12), 4, 2], {}), ([r(2, 5, 6), 2, 1], {})],
        "aten.unsafe_split.Tensor": [([r(2, 4, 12), 4, 2], {})],
        "aten.chunk.default": [([r(2, 4, 12), 3, -1], {})],
        "aten.split_with_sizes.default": [([r(2, 4, 12), [4, 8], 2], {}),
                                          ([r(2, 4, 12), [6, 6], 2], {})],
        "aten.cat.default": [([[r(2, 4, seed=1), r(2, 4, seed=2)], 1], {}),
                             ([[r(2, 4), r(2, 2)], -1], {})],
        "aten.stack.default": [([[r(2, 4, seed=1), r(2, 4, seed=2)], 1], {})],
        "aten.unbind.int": [([x, 1], {})],
        "aten.select.int": [([x, 1, 2], {})],
        "aten.slice.Tensor": [([x, 2, 0, 9223372036854775807, 1], {}), ([x, 1, 1, None, 2], {}),
                              ([x, 2, 1, 4], {})],
        "aten.expand.default": [([r(2, 1, 6), [2, 4, 6]], {}), ([r(6), [3, 4, -1]], {})],
        "aten.roll.default": [([x, [1, -2], [1, 2]], {})],
        "aten.repeat_interleave.self_int": [([r(2, 3, 4), 2, 2], {}), ([r(4, 3), 3, 0], {}),
                                            ([r(2, 3, 4), 2, -1], {"output_size": 8})],
        "aten.repeat.default": [([r(2, 1, 6), [4, 3, 1]], {}), ([r(3, 2), [2, 2, 1]], {}),
                                ([r(4, 1, 6), [2, 1, 1, 2]], {})],
        "aten.index.Tensor": [([r(10, 4), [ints(10, 6, 2)]], {}),
                              ([r(4, 10), [None, ints(10, 6)]], {}),
                              ([r(4, 10, 6), [ints(4, 8, 1), ints(10, 1, 2)]], {}),
                              ([r(3, 4, 10), [None, ints(4, 6), ints(10, 6)]], {}),
                              ([r(4, 3, 10), [ints(4, 6), None, ints(10, 6)]], {})],
        "aten.sum.dim_IntList": [([x, [1]], {}), ([x, [0, 2], True], {})],
        "aten.sum.default": [([x], {})],
        "aten.mean.dim": [([x, [-1]], {}), ([x, [1], True], {})],
        "aten.mean.default": [([x], {})],
        "aten.amax.default": [([x, [1]], {})],
        "aten.amin.default": [([x, [1]], {})],
        "aten.max.dim": [([x, 1], {})],
        "aten.min.dim": [([x, 1, True], {})],
        "aten.argmax.default": [([x, 2], {})],
        "aten.logsumexp.default": [([x, [2]], {})],
        "aten.var.correction": [([x, [2]], {"correction": 1, "keepdim": True})],
        "aten.std.correction": [([x, [2]], {"correction": 1})],
        "aten.norm.ScalarOpt_dim": [([x, 2, [2]], {})],
        "aten.prod.dim_int": [([x, 1], {})],
        "aten.all.dim": [([x > 0, 1], {})],
        "aten.any.dim": [([x > 0, 1], {})],
        "aten.softmax.int": [([x, -1], {})],
        "aten._softmax.default": [([x, 1, False], {})],
        "aten.log_softmax.int": [([x, -1], {})],
        "aten._log_softmax.default": [([x, 2, False], {})],
        "aten.cumsum.default": [([x, 2], {})],
        "aten.layer_norm.default": [([x, [6], r(6), r(6), 1e-5], {}), ([x, [4, 6]], {})],
        "aten.rms_norm.default": [([x, [6], r(6), 1e-6], {})],
        "aten.group_norm.default": [([r(2, 4, 3, 3), 2, r(4), r(4)], {}),
                                    ([r(2, 8, 3, 3), 4, r(8), r(8), 1e-5], {}),
                                    ([r(2, 6, 2, 2), 3], {}), ([r(2, 4, 3), 1, r(4), r(4)], {})],
        "aten.scaled_dot_product_attention.default": [
            ([r(2, 4, 6, 4, seed=1), r(2, 4, 6, 4, seed=2), r(2, 4, 6, 2, seed=3)],
             {"is_causal": True}),
            ([r(2, 4, 6, 4, seed=1), r(2, 4, 5, 4, seed=2), r(2, 4, 5, 4, seed=3),
              r(2, 1, 6, 5) > -1], {}),
            ([r(2, 4, 6, 4, seed=1), r(2, 2, 6, 4, seed=2), r(2, 2, 6, 4, seed=3)],
             {"enable_gqa": True, "scale": 0.3}),
            ([r(2, 4, 6, 4, seed=1), r(2, 4, 6, 4, seed=2), r(2, 4, 6, 4, seed=3),
              r(6, 6)], {})],
        "aten.embedding.default": [([r(10, 6), ints(10, 2, 4)], {})],
        "aten.cross_entropy_loss.default": [([r(8, 5), ints(5, 8)], {}),
                                            ([r(4, 5, 6), ints(5, 4, 6)], {"reduction": 2}),
                                            ([r(8, 5), ints(5, 8), None, 0], {}),
                                            ([r(8, 5), ints(5, 8), r(5, positive=True)], {})],
        "aten.nll_loss.default": [([r(8, 5), ints(5, 8)], {})],
        "aten.nll_loss_nd.default": [([r(4, 5, 6), ints(5, 4, 6)], {})],
        "aten.mse_loss.default": [([r(4, 6), r(4, 6, seed=9)], {})],
        "aten.l1_loss.default": [([r(4, 6), r(4, 6, seed=9)], {"reduction": 2})],
        "aten.smooth_l1_loss.default": [([r(4, 6), r(4, 6, seed=9)], {})],
        "aten.binary_cross_entropy_with_logits.default": [([r(4, 6), r(4, 6).sigmoid()], {})],
        "aten._weight_norm.default": [([r(6, 4, 3), r(6, 1, 1, positive=True), 0], {}),
                                      ([r(4, 2, 6), r(1, 1, 6, positive=True), 2], {}),
                                      ([r(4, 6), r(4, 1, positive=True), -2], {})],
        "aten.conv1d.default": [([r(2, 4, 8), r(6, 4, 3), r(6)], {})],
        "aten.conv2d.default": [([r(2, 4, 8, 8), r(6, 4, 2, 2), r(6), [2, 2]], {}),
                                ([r(2, 4, 6, 6), r(4, 2, 3, 3), None, [1, 1], [1, 1], [1, 1], 2],
                                 {}),
                                # depthwise (a group per channel, two outputs each), with a bias
                                ([r(2, 4, 6, 6), r(8, 1, 3, 3), r(8), [1, 1], [1, 1], [1, 1], 4],
                                 {}),
                                # grouped, groups by keyword
                                ([r(2, 6, 4, 4), r(9, 2, 1, 1), r(9)], {"groups": 3})],
        "aten.conv3d.default": [([r(2, 2, 4, 4, 4), r(4, 2, 2, 2, 2), None, [2, 2, 2]], {})],
        "aten.arange.default": [([8], {})],
        "aten.arange.start": [([2, 10], {})],
        "aten.arange.start_step": [([1, 17, 2], {})],
        "aten.zeros.default": [([[4, 6]], {"dtype": D})],
        "aten.ones.default": [([[4, 6]], {"dtype": D})],
        "aten.empty.memory_format": [([[4, 6]], {"dtype": D})],
        "aten.full.default": [([[4, 6], 1.5], {"dtype": D})],
        "aten.new_zeros.default": [([x, [4, 6]], {}), ([x, [2, 4, 6]], {}), ([x, [2, 4, 3]], {})],
        "aten.new_ones.default": [([x, [4, 6]], {})],
        "aten.new_full.default": [([x, [4, 6], 2.0], {})],
        "aten.new_empty.default": [([x, [4, 6]], {})],
        "aten.tril.default": [([r(2, 4, 4)], {})],
        "aten.gather.default": [([r(4, 6), 1, ints(6, 4, 3)], {}), ([r(4, 6), 0, ints(4, 4, 6)], {}),
                                ([r(4, 6), 1, ints(6, 2, 3)], {})],
        # repeated indices add up; ``scatter`` and ``scatter_reduce`` get one index per place
        # (``UNIQUE``: which of two writes wins is not defined)
        "aten.scatter_add.default": [([r(4, 6), 1, ints(6, 4, 3), r(4, 3, seed=1)], {}),
                                     ([r(4, 6), 0, ints(4, 2, 6), r(2, 6, seed=1)], {}),
                                     ([r(4, 6), 1, ints(6, 2, 3), r(3, 3, seed=1)], {})],
        "aten.scatter.src": [([r(4, 6), 1, UNIQUE, r(4, 3, seed=1)], {})],
        "aten.scatter_reduce.two": [([r(4, 6), 1, UNIQUE, r(4, 3, seed=1), "sum"], {}),
                                    ([r(4, 6), 1, ints(6, 4, 3), r(4, 3, seed=1), "amax"],
                                     {"include_self": False})],
        "aten.pad.default": [([r(2, 4, 6), [1, 2]], {}), ([r(2, 4, 6), [0, 0, 1, 1], "constant", 0.5],
                                                      {}),
                             ([r(2, 4, 6), [0, 0, 1, 2]], {}), ([r(2, 4, 6), [0, 0, 0, 0]], {}),
                             # a reflection and a replication pad only the last dims
                             ([r(2, 3, 4, 5), [1, 2, 2, 1], "reflect"], {}),
                             ([r(2, 3, 5), [2, 1], "replicate"], {}),
                             ([r(2, 3, 4, 5), [1, 1, 1, 1], "circular"], {})],
        "aten.constant_pad_nd.default": [([r(2, 4, 6), [1, 1, 0, 0], 0.0], {}),
                                         ([r(2, 4, 6), [1, 1], 0.5], {})],
        "aten.adaptive_avg_pool1d.default": [([r(2, 4, 6), [1]], {})],
        "aten.adaptive_avg_pool2d.default": [([r(2, 4, 6, 6), [1, 1]], {}),
                                             ([r(2, 4, 6, 6), [3, 3]], {})],
        "aten._adaptive_avg_pool2d.default": [([r(2, 4, 6, 6), [1, 1]], {})],
        "aten.adaptive_avg_pool3d.default": [([r(2, 2, 4, 4, 4), [1, 1, 1]], {})],
        "aten.max_pool1d.default": [([r(2, 4, 6), [2]], {})],
        "aten.max_pool2d.default": [([r(2, 4, 6, 6), [2, 2], [2, 2]], {})],
        "aten.max_pool3d.default": [([r(2, 2, 4, 4, 4), [2, 2, 2]], {})],
        "aten.avg_pool1d.default": [([r(2, 4, 6), [3]], {})],
        "aten.avg_pool2d.default": [([r(2, 4, 6, 6), [3, 3], [1, 1], [1, 1]], {})],
        "aten.avg_pool3d.default": [([r(2, 2, 4, 4, 4), [2, 2, 2]], {})],
        # running statistics are buffers (no gradient), which this oracle cannot pass
        "aten.batch_norm.default": [([r(4, 6, 3, 3), r(6), r(6), None, None,
                                      True, 0.1, 1e-5, False], {}),
                                     ([r(4, 6, 3), None, None, None, None,
                                       True, 0.1, 1e-5, False], {})],
        "aten.triu.default": [([r(2, 4, 4), 1], {})],
        "aten.sort.default": [([r(4, 6)], {}), ([r(4, 6), 0, True], {})],
        "aten.sort.stable": [([r(4, 6)], {"stable": True, "dim": 0})],
        "aten.argsort.default": [([r(4, 6), -1, True], {})],
        "aten.argsort.stable": [([r(2, 4, 6)], {"stable": True, "dim": 1})],
        "aten.topk.default": [([r(4, 6), 3], {}), ([r(4, 6), 2, 0, False], {})],
        "aten.std.dim": [([r(4, 6), [1]], {}), ([r(4, 6), [0], True, True], {})],
        "aten.var.dim": [([r(2, 4, 6), [1], False], {})],
        "aten.var_mean.dim": [([r(2, 4, 6), [1]], {})],
        "aten.var_mean.correction": [([r(4, 6), [1]], {"correction": 0, "keepdim": True})],
        "aten.std_mean.dim": [([r(4, 6), [0]], {})],
        "aten.std_mean.correction": [([r(4, 6), [1]], {"correction": 1})],
        "aten.cumprod.default": [([r(4, 6), 1], {})],
        "aten.logcumsumexp.default": [([r(4, 6), 0], {})],
        "aten.cosine_similarity.default": [([r(4, 6), r(4, 6, seed=1)], {}),
                                           ([r(2, 4, 6), r(4, 6, seed=1), 2], {})],
        "aten.pairwise_distance.default": [([r(4, 6), r(4, 6, seed=1)], {}),
                                           ([r(4, 6), r(6, seed=1), 1.0, 1e-6, True], {})],
        "aten.flip.default": [([r(4, 6), [1]], {}), ([r(2, 4, 6), [0, 2]], {})],
        "aten.movedim.int": [([r(2, 4, 6), 0, -1], {}), ([r(2, 4, 6), 2, 0], {})],
        "aten.narrow.default": [([r(4, 6), 1, 1, 3], {}), ([r(4, 6), 0, 0, 4], {})],
        "aten.unfold.default": [([r(4, 6), 1, 2, 2], {}), ([r(2, 4, 6), 2, 3, 1], {})],
        "aten.outer.default": [([r(4), r(6, seed=1)], {})],
        "aten.one_hot.default": [([ints(5, 4, 3), 5], {})],
        "aten.index_select.default": [([r(4, 6), 1, torch.tensor([0, 2, 5, 2])], {}),
                                      ([r(4, 6), 0, torch.tensor([3, 1])], {})],
        "aten.pixel_shuffle.default": [([r(2, 8, 3, 3), 2], {})],
        "aten.pixel_unshuffle.default": [([r(2, 2, 4, 4), 2], {})],
        "aten.glu.default": [([r(4, 6)], {}), ([r(4, 6), 0], {})],
        "aten.prelu.default": [([r(2, 3, 4), r(3, seed=1)], {}), ([r(2, 3, 4), r(1, seed=1)], {})],
        "aten.instance_norm.default": [([r(2, 3, 4, 4), r(3, seed=1), r(3, seed=2), None, None,
                                         True, 0.1, 1e-5, False], {}),
                                        ([r(2, 3, 5), None, None, None, None, True, 0.1, 1e-5,
                                          False], {})],
    })
    s.update({
        "aten.conv_transpose1d.default": [([r(2, 4, 5), r(4, 3, 3), r(3)], {}),
                                          ([r(2, 4, 5), r(4, 3, 2), None, [2]], {})],
        "aten.conv_transpose2d.input": [([r(2, 4, 3, 3), r(4, 6, 2, 2), r(6), [2, 2]], {}),
                                        ([r(2, 4, 3, 3), r(4, 3, 3, 3), None, [1, 1], [1, 1],
                                          [0, 0], 2], {})],  # 2 groups
        "aten.conv_transpose3d.input": [([r(1, 2, 2, 2, 2), r(2, 4, 2, 2, 2), r(4), [2, 2, 2]],
                                         {})],
    })
    for n in ["leaky_relu", "elu", "celu", "selu", "threshold"]:
        extra = {"threshold": [0.1, -2.0]}.get(n, [])
        s[f"aten.{n}_.default"] = [([r(4, 6), *extra], {})]
    s["aten.col2im.default"] = [([r(2, 12, 9), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1]], {}),
                                ([r(2, 12, 4), [4, 4], [2, 2], [1, 1], [0, 0], [2, 2]], {})]
    s.update({
        "aten.adaptive_max_pool1d.default": [([r(2, 3, 6), [3]], {})],
        "aten.adaptive_max_pool2d.default": [([r(2, 3, 4, 4), [2, 2]], {})],
        "aten.adaptive_max_pool3d.default": [([r(1, 2, 2, 4, 4), [1, 2, 2]], {})],
        "aten.grid_sampler.default": [([r(2, 3, 4, 5), torch.tanh(r(2, 4, 2, 2, seed=1)), 0, 0,
                                        False], {})],
        "aten.grid_sampler_2d.default": [([r(2, 3, 4, 5), torch.tanh(r(2, 2, 4, 2, seed=1)), 1,
                                           1, True], {})],
        "aten.grid_sampler_3d.default": [([r(1, 2, 3, 3, 3), torch.tanh(r(1, 2, 2, 2, 3, seed=1)),
                                           0, 0, False], {})],
        "aten.cdist.default": [([r(2, 4, 3), r(2, 6, 3, seed=1)], {}),
                               ([r(4, 3), r(6, 3, seed=1), 1.0], {})],
        "aten._cdist_forward.default": [([r(2, 4, 3), r(2, 6, 3, seed=1), 2.0, None], {})],
    })
    big, line, cube = r(2, 3, 4, 4), r(2, 3, 5), r(1, 2, 2, 3, 3)
    for name, x, vec, default in [
            ("upsample_nearest1d", line, [None, [2.0]], [[10]]),
            ("upsample_nearest2d", big, [None, [2.0, 2.0]], [[8, 6]]),
            ("upsample_nearest3d", cube, [None, [2.0, 2.0, 2.0]], [[4, 6, 6]]),
            ("_upsample_nearest_exact1d", line, [[8], None], [[8]]),
            ("_upsample_nearest_exact2d", big, [None, [1.5, 2.0]], [[6, 8]]),
            ("_upsample_nearest_exact3d", cube, [[3, 4, 4], None], [[3, 4, 4]]),
            ("upsample_linear1d", line, [[9], False, None], [[9], True]),
            ("upsample_bilinear2d", big, [None, True, [2.0, 2.0]], [[8, 6], False]),
            ("upsample_bicubic2d", big, [[6, 6], False, None], [[6, 7], True]),
            ("upsample_trilinear3d", cube, [[3, 4, 4], False, None], [[4, 5, 5], True]),
            ("_upsample_bilinear2d_aa", r(2, 3, 8, 8), [[4, 4], False, None], [[4, 5], False])]:
        s[f"aten.{name}.vec"] = [([x, *vec], {})]
        s[f"aten.{name}.default"] = [([x, *default], {})]
    from tests.test_ops_losses import SAMPLES as LOSSES
    from tests.test_ops_recurrent import SAMPLES as RECURRENT
    from tests.test_ops_user_reports import SAMPLES as REPORTED
    s.update({t: [(a, k) for a, k, _ in calls] for t, calls in REPORTED.items()})
    s.update({t: [(a, k) for a, k, _ in calls] for t, calls in RECURRENT.items()})
    s.update({t: [(a, k) for a, k, _ in calls] for t, calls in LOSSES.items()})
    return s


SAMPLES = _samples()
# Ops whose output values are undefined: only shapes and regions can be compared.
UNDEFINED = {"aten.empty.memory_format", "aten.new_empty.default"}
CASES = [(t, i) for t in sorted(registered()) if t not in UNDEFINED
         for i in range(len(SAMPLES.get(t, [])))]


def test_every_registered_op_has_a_sample() -> None:
    missing = sorted(set(registered()) - set(SAMPLES))
    assert not missing, f"registered ops without a sample call: {missing}"


def _parts_for(ann: Annotation, label: str) -> list[int]:
    size = ann.sizes()[label]
    return [n for n in (2, 3) if size % n == 0][:1] or []


@pytest.mark.parametrize(("target", "index"), CASES)
def test_split_parts_combine_to_whole(target: str, index: int) -> None:
    args, kwargs = SAMPLES[target][index]
    call, values = make_call(target, args, kwargs)
    ann = annotate_call(call)
    assert not isinstance(ann, NotAnnotated), ann
    labels = ann.splittable()
    for label in labels:
        for n in _parts_for(ann, label):
            check_parts(call, ann, values, equal_parts(ann, label, n))


@pytest.mark.parametrize(("target", "index"), CASES)
def test_split_of_an_inner_factor_combines_to_whole(target: str, index: int) -> None:
    """Every rule keeps its meaning when the tracer cuts a label into factors (a Conv1D's input
    features viewed as heads): a split of the inner factor starts every part off the label's
    start, so a rule that tests the label by name (a bias added by "the first part") fails."""
    args, kwargs = SAMPLES[target][index]
    call, values = make_call(target, args, kwargs)
    ann = annotate_call(call)
    for label in ann.splittable():
        size = ann.sizes()[label]
        if size % 4 == 0 or (size % 2 == 0 and size > 2):
            cut = ann.refined(label, [2, size // 2])
            inner = f"{label}.1"
            for n in _parts_for(cut, inner):
                try:
                    check_parts(call, cut, values, equal_parts(cut, inner, n))
                except FrozenDimError as refused:  # a refusal that says why is allowed
                    assert "strided" in str(refused)


def test_nested_partition_of_two_labels() -> None:
    """A 2-D plan: linear split along out features and the contracted dim at once."""
    call, values = make_call("aten.linear.default", [r(4, 8), r(6, 8), r(6)])
    ann = annotate_call(call)
    parts = [{"n": (a, a + 3), "k": (b, b + 4)} for a in (0, 3) for b in (0, 4)]
    check_parts(call, ann, values, parts)


def test_strided_region_of_fused_qkv() -> None:
    """Splitting the h inside (3 h d) reads one interval per q/k/v block."""
    call, values = make_call("aten.linear.default", [r(2, 8), r(24, 8), r(24)])
    ann = annotate_call(call).refined("n", [3, 4, 2])
    part = ann.split(call, "n.1", 2, 1)
    assert part.outputs[0][1] == ((4, 8), (12, 16), (20, 24))
    assert part.inputs[1][0] == ((4, 8), (12, 16), (20, 24))
    check_parts(call, ann, values, equal_parts(ann, "n.1", 2))


def test_refused_splits_say_why() -> None:
    call, _ = make_call("aten.softmax.int", [r(2, 4, 6), -1])
    ann = annotate_call(call)
    with pytest.raises(FrozenDimError, match="softmax normalizes along it"):
        ann.split(call, "d2", 2, 0)
    with pytest.raises(IndivisibleError):
        ann.split(call, "d1", 3, 0)
    with pytest.raises(UnknownDimError, match="its dimensions"):
        ann.split(call, "nope", 2, 0)


def test_causal_attention_freezes_query_sequence() -> None:
    call, _ = make_call("aten.scaled_dot_product_attention.default",
                        [r(1, 2, 4, 2), r(1, 2, 4, 2), r(1, 2, 4, 2)], {"is_causal": True})
    labels = annotate_call(call).labels()
    assert labels["L"].mark == "frozen" and "causal" in labels["L"].reason
    assert labels["b1"].mark == "spatial"


@pytest.mark.parametrize("target", ["aten.numpy_T.default", "aten.mT.default",
                                    "aten.adjoint.default", "aten.matrix_H.default"])
def test_matrix_transposes_are_annotated(target: str) -> None:
    """``weight.T`` (Falcon's linear: ``x @ self.weight.T``), ``x.mT``, ``x.adjoint()`` and
    ``x.H`` stay in an exported graph as their own operators; each split of each dim combines
    to what PyTorch computes on the whole."""
    for args, kwargs in SAMPLES[target]:
        call, values = make_call(target, args, kwargs)
        ann = annotate_call(call)
        assert not isinstance(ann, NotAnnotated), ann
        assert len(ann.splittable()) == len(call.in_shapes[0])
        for label in ann.splittable():
            for n in _parts_for(ann, label):
                check_parts(call, ann, values, equal_parts(ann, label, n))


@pytest.mark.parametrize("index", [1, 2, 3])
def test_grouped_conv_splits_by_whole_groups(index: int) -> None:
    """A grouped conv (a depthwise one: SegFormer's Mix-FFN, ConvNeXt, MobileNet) splits by its
    groups, input channels, weight rows and output channels alike, the local conv with the
    part's number of groups (it was refused: 'grouped convolution'); the parts combine to what
    PyTorch computes on the whole."""
    args, kwargs = SAMPLES["aten.conv2d.default"][index]
    call, values = make_call("aten.conv2d.default", args, kwargs)
    ann = annotate_call(call)
    assert "G" in ann.splittable()
    assert dict(ann.words)["out"] == "G"
    for label in ann.splittable():
        for n in _parts_for(ann, label):
            check_parts(call, ann, values, equal_parts(ann, label, n))


@pytest.mark.parametrize("index, kept", [(0, "d0"), (1, "d2"), (2, "d0")])
def test_weight_norm_splits_along_its_dim(index: int, kept: str) -> None:
    """``_weight_norm(v, g, dim)`` (Wav2Vec2's positional conv, once unannotated): a norm for
    each index of ``dim``, so it splits along ``dim`` only; the parts combine to PyTorch's."""
    args, kwargs = SAMPLES["aten._weight_norm.default"][index]
    call, values = make_call("aten._weight_norm.default", args, kwargs)
    ann = annotate_call(call)
    assert not isinstance(ann, NotAnnotated), ann
    assert ann.splittable() == [kept]
    check_parts(call, ann, values, equal_parts(ann, kept, 2))


def test_a_sort_keeps_the_dim_it_orders_whole() -> None:
    """``topk`` over experts (an MoE router) splits along the tokens, never the experts."""
    call, values = make_call("aten.topk.default", [r(8, 6), 2])
    ann = annotate_call(call)
    assert sorted(ann.splittable()) == ["d0"]
    check_parts(call, ann, values, equal_parts(ann, "d0", 4))
    with pytest.raises(FrozenDimError, match="orders the whole dim"):
        ann.split(call, "d1", 2, 0)


@pytest.mark.parametrize("target, args", [("aten.sort.default", [r(12)]),
                                          ("aten.argsort.default", [r(12)]),
                                          ("aten.topk.default", [r(12), 3])])
def test_a_one_dim_sort_has_no_annotation(target, args) -> None:
    """Nothing of it can split (an MoE's sort of every token's expert, flattened): left without
    an annotation, a selection such as dp's ``partition all`` replicates it, as it did before
    sorts had one, instead of refusing the plan."""
    call, _ = make_call(target, args)
    ann = annotate_call(call)
    assert isinstance(ann, NotAnnotated) and "orders all of it" in ann.reason
