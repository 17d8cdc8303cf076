"""Elementwise operators (unary, binary with broadcasting, casts and copies): every output dim
is spatial; an input dim broadcast from size 1 is read whole by every part."""

from __future__ import annotations

from ssdsl.ops.build import broadcast, dims, norm_dim, plain
from ssdsl.ops.core import Annotation, Call, register

UNARY = [
    "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "neg", "rsqrt", "sqrt", "abs", "sin",
    "cos", "reciprocal", "square", "erf", "log1p", "expm1", "sign", "hardtanh", "leaky_relu", "elu",
    "softplus", "clamp", "clamp_min", "clamp_max", "logical_not", "bitwise_not", "isnan",
    "hardswish", "hardsigmoid", "mish",
    # found missing in exported models and losses (``F.logsigmoid`` in multilabel soft margin,
    # SELU networks, ``relu6`` in mobile nets, rounding in quantization-aware code)
    "log_sigmoid", "selu", "celu", "relu6", "log2", "log10", "exp2", "floor", "ceil", "round",
    "trunc", "frac", "sgn", "tan", "atan", "asin", "acos", "sinh", "cosh", "asinh", "atanh",
    "erfc", "erfinv", "digamma", "lgamma", "logit", "softshrink", "hardshrink", "threshold",
    "nan_to_num", "signbit", "deg2rad", "rad2deg", "sinc",
]
IDENTITY = ["clone", "contiguous", "alias", "detach", "_to_copy", "lift_fresh_copy",
            "dropout"]
BINARY_TENSOR = ["add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and",
                 "bitwise_or", "remainder", "fmod", "xlogy", "copysign"]
BINARY_DEFAULT = ["maximum", "minimum", "logical_and", "logical_or", "atan2", "floor_divide",
                  "hypot", "logaddexp", "logaddexp2"]

# ``torch.multiply`` / ``divide`` / ``subtract`` / ``true_divide`` keep their own names in an
# exported graph (ConvBERT's ``torch.multiply(query, key_conv)``): aliases of mul, div, sub.
ALIASES = ([f"aten.{n}.{o}" for n in ["multiply", "divide", "subtract", "true_divide"]
            for o in ["Tensor", "Scalar"]]
           + ["aten.divide.Tensor_mode"])

_targets = (
    [f"aten.{n}.default" for n in UNARY + IDENTITY + BINARY_DEFAULT]
    + [f"aten.{n}.Tensor" for n in BINARY_TENSOR]
    + [f"aten.{n}.Scalar" for n in ["add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt",
                                    "ge", "rsub", "remainder", "fmod"]]
    + ["aten.__and__.Tensor", "aten.__or__.Tensor", "aten.__and__.Scalar", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar", "aten.rsub.Tensor",
       "aten.div.Tensor_mode", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device",
       "aten.where.self", "aten.where.ScalarSelf",
       "aten.where.ScalarOther", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
       "aten.clamp.Tensor", "aten.lerp.Scalar", "aten.lerp.Tensor", "aten.addcmul.default",
       "aten.addcdiv.default", "aten.gelu.default", "aten.fill.Scalar", "aten.zeros_like.default",
       "aten.ones_like.default", "aten.full_like.default", "aten.bitwise_not.default",
       "aten.float.default", "aten.min.other", "aten.max.other"]
    + ALIASES
    # each element's real or imaginary part (FNet's ``torch.fft.fftn(x, dim=(1, 2)).real``)
    + ["aten.real.default", "aten.imag.default"]
)

# In-place forms (``x.add_(y)``, ``relu_``, ``masked_fill_``, ``copy_``): annotated as their
# out-of-place forms, output like the written tensor. A part writes its piece of the local
# tensor, so the write reaches the tensor it aliases (the base of a slice) only where producer,
# view and writer sit on the same device with nothing moved between them (docs/operators.md).
IN_PLACE = (
    [f"aten.{n}_.default" for n in ["relu", "gelu", "silu", "sigmoid", "tanh", "exp", "neg",
                                     "sqrt", "rsqrt", "abs", "reciprocal", "zero",
                                     "hardswish", "hardsigmoid", "hardtanh", "mish",
                                     # ``inplace=True`` activations (CSPDarkNet's, TResNet's)
                                     "leaky_relu", "elu", "celu", "selu", "threshold"]]
    + [f"aten.{n}_.Tensor" for n in ["add", "sub", "mul", "div"]]
    + [f"aten.{n}_.Scalar" for n in ["add", "sub", "mul", "div", "fill", "masked_fill"]]
    + ["aten.masked_fill_.Tensor", "aten.fill_.Tensor", "aten.copy_.default", "aten.clamp_.default",
       "aten.clamp_min_.default", "aten.clamp_max_.default", "aten.detach_.default"]
)


@register(*dict.fromkeys(t for t in [*_targets, *IN_PLACE] if t != "aten.float.default"))
def elementwise(call: Call) -> Annotation:
    (out,) = call.out_shapes
    ins, sig = broadcast(call.in_shapes, out)
    return Annotation(ins, (sig,))


@register("aten.type_as.default", "aten.to.other")
def cast_like(call: Call) -> Annotation:
    """``x.type_as(y)``, ``x.to(y)``: ``x`` cast to ``y``'s dtype and device, elementwise in
    ``x``; ``y`` is read for its dtype and device only, and may have any shape (DeBERTa-v2 casts
    a 0-dim scale ``type_as`` its (seq, seq) position table). A dim of ``y`` at an output dim's
    position and of its size shares its label (split alike); any other dim of ``y`` is ignored:
    every piece of it gives the same output."""
    (out,) = call.out_shapes
    (x_sig,), sig = broadcast(call.in_shapes[:1], out)
    other = call.in_shapes[1]
    labels = dims(len(out))
    aligned = len(other) == len(out)
    y_labels = [labels[k] if aligned and s == out[k] else f"x{k}" for k, s in enumerate(other)]
    ignored = frozenset(lab for lab in y_labels if lab.startswith("x"))
    return Annotation((x_sig, plain(y_labels, other)), (sig,), ignored=ignored)


@register("aten.scalar_tensor.default")
def scalar_tensor(call: Call) -> Annotation:
    """A 0-dim tensor from a number: nothing to split, made whole by every part."""
    return Annotation((), ((),))


@register("aten.broadcast_tensors.default")
def broadcast_tensors(call: Call) -> Annotation:
    """``broadcast_tensors(a, b, ...)`` (``F.mse_loss`` of tensors traces through it): every
    output is its input broadcast to the common shape, split like an elementwise result; an
    input dim broadcast from size 1 is read whole by every part."""
    common = call.out_shapes[0]
    ins, sig = broadcast(call.in_shapes, common)
    return Annotation(ins, tuple(sig for _ in call.out_shapes))


@register("aten.glu.default")
def glu(call: Call) -> Annotation:
    """``F.glu(x, dim)``: the first half of ``dim`` gated by the second, that dim whole; the
    other dims independent."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dim", -1), len(src))
    labels = dims(len(src))
    why = "each output gates its value with the element half the dim away"
    return Annotation((plain(labels, src),), (plain([*labels[:d], "h", *labels[d + 1:]], dst),),
                      frozen={labels[d]: why, "h": why})


@register("aten.prelu.default")
def prelu(call: Call) -> Annotation:
    """``F.prelu(x, weight)``: elementwise; a weight of one slope per channel (dim 1) splits
    with the channels, a single slope is read whole."""
    x, w = call.in_shapes
    labels = dims(len(x))
    if len(w) == 1 and len(x) >= 2 and w[0] == x[1] and w[0] > 1:
        w_sig = plain([labels[1]], w)
    else:
        w_sig = plain([f"w{k}" for k in range(len(w))], w)
    return Annotation((plain(labels, x), w_sig), (plain(labels, x),))
