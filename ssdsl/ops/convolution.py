"""Convolutions. Batch and output channels are spatial; input channels are reduced (a bias only
in part 0); a spatial dim can be split only for a patch embedding (kernel = stride, no padding,
no dilation), where each output position reads its own patch: input ``H = (Ho kh)``."""

from __future__ import annotations

from ssdsl.ops.build import first_value_part, set_arg
from ssdsl.ops.core import Annotation, Call, Factor, LocalCall, by_extent, register


def _tuple(v, n: int) -> tuple[int, ...]:
    return tuple(v) * (n // len(v)) if isinstance(v, (list, tuple)) else (v,) * n


@register("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default")
def conv(call: Call) -> Annotation:
    x, w = call.shape(0, "input"), call.shape(1, "weight")
    nsp = len(w) - 2
    stride, padding, dilation = (_tuple(call.arg(i, n, d), nsp) for i, n, d in
                                 ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1)))
    groups = call.arg(6, "groups", 1)
    (out,) = call.out_shapes
    batched = len(x) == nsp + 2
    lead = [(Factor("N", x[0]),)] if batched else []
    frozen = {}
    x_sp, w_sp, o_sp = [], [], []
    for k in range(nsp):
        h, kh, ho = x[-nsp + k], w[2 + k], out[-nsp + k]
        patch = stride[k] == kh and padding[k] == 0 and dilation[k] == 1 and h == ho * kh
        if patch:
            x_sp.append((Factor(f"o{k}", ho), Factor(f"k{k}", kh)))
        else:
            x_sp.append((Factor(f"h{k}", h),))
            frozen[f"h{k}"] = "a convolution window crosses the boundary of a part"
        w_sp.append((Factor(f"k{k}", kh),))
        o_sp.append((Factor(f"o{k}", ho),))
        frozen[f"k{k}"] = "a kernel dim"
        if not patch:
            frozen[f"o{k}"] = "a convolution window crosses the boundary of a part"
    cin, cout = x[-nsp - 1], w[0]
    if groups == 1:
        x_c, w_c, reduced = (Factor("Ci", cin),), (Factor("Ci", cin),), frozenset({"Ci"})
    else:  # grouped: channels are (g c); each group a separate conv
        x_c = (Factor("g", groups), Factor("Ci", cin // groups))
        w_c = (Factor("Ci", cin // groups),)
        reduced = frozenset()
        frozen.update(g="grouped convolution", Ci="grouped convolution",
                      Co="grouped convolution")
    ins = [(*lead, x_c, *x_sp), ((Factor("Co", cout),), w_c, *w_sp)]
    if call.arg(2, "bias") is not None:
        ins.append(((Factor("Co", cout),),))
    return Annotation(tuple(ins), ((*lead, (Factor("Co", cout),), *o_sp),), reduced=reduced,
                      frozen=frozen, words=CHANNEL_WORDS, lower=_lower_conv)


# The words a linear layer takes (``FEATURE_WORDS``): output and input channels.
CHANNEL_WORDS = {"out": "Co", "in": "Ci"}


@by_extent
def _lower_conv(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    if not first_value_part(ann, ranges):
        args, kw = set_arg(args, kwargs, 2, "bias", None)
        return LocalCall(call.op.target, args, kw)
    return LocalCall(call.op.target, args, tuple(kwargs.items()))
