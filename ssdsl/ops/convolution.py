"""Convolutions. Batch and output channels are spatial; input channels are reduced (a bias only
in part 0); a spatial dim can be split only for a patch embedding (kernel = stride, no padding,
no dilation), where each output position reads its own patch: input ``H = (Ho kh)``. A grouped
convolution's groups are spatial too (a part holds whole groups)."""

from __future__ import annotations

import math

from ssdsl.ops.build import extent, first_value_part, set_arg
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
    words, lower = CHANNEL_WORDS, _lower_conv
    if groups == 1:
        x_c, w_c, reduced = (Factor("Ci", cin),), (Factor("Ci", cin),), frozenset({"Ci"})
        o_c = (Factor("Co", cout),)
    else:
        # grouped (a depthwise conv: one group per channel): channels are (g c), group j of
        # the output reads group j of the input only, so a part takes whole groups, of the
        # input, the weight's rows and the output alike (the depthwise conv between the two
        # linears of SegFormer's Mix-FFN follows their column-parallel split); inside a group
        # the input channels are reduced and the output channels spatial, as in a plain conv
        # (the groups are "G": the labels' product is the conv's iteration space, which the
        # cost model's conv rule, dividing by a "g" of the input alone, takes as is)
        x_c = (Factor("G", groups), Factor("Ci", cin // groups))
        w_c = (Factor("Ci", cin // groups),)
        o_c = (Factor("G", groups), Factor("Co", cout // groups))
        reduced = frozenset({"Ci"})
        words, lower = GROUPED_WORDS, _lower_grouped_conv(cin // groups, len(lead))
    ins = [(*lead, x_c, *x_sp), (o_c, w_c, *w_sp)]
    if call.arg(2, "bias") is not None:
        ins.append((o_c,))
    windows = frozenset(label for label in frozen if label.startswith("h"))
    return Annotation(tuple(ins), ((*lead, o_c, *o_sp),), reduced=reduced,
                      frozen=frozen, words=words, lower=lower, windows=windows)


# The words a linear layer takes (``FEATURE_WORDS``): output and input channels. A grouped
# conv's output channels split by whole groups.
CHANNEL_WORDS = {"out": "Co", "in": "Ci"}
GROUPED_WORDS = {"out": "G", "in": "Ci"}


@by_extent
def _lower_conv(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    if not first_value_part(ann, ranges):
        args, kw = set_arg(args, kwargs, 2, "bias", None)
        return LocalCall(call.op.target, args, kw)
    return LocalCall(call.op.target, args, tuple(kwargs.items()))


def _lower_grouped_conv(per_group: int, channel_dim: int):
    """A part's conv has as many groups as the part holds (its input channels over a group's
    channels, split or not: the input channels of a group are split alike in every group)."""
    @by_extent
    def lower(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
        channels = math.prod(extent(f, ranges) for f in ann.inputs[0][channel_dim])
        inside = math.prod(extent(f, ranges) for f in ann.inputs[1][1])
        local = _lower_conv(call, ann, ranges, args, kwargs)
        largs, lkw = set_arg(local.args, dict(local.kwargs), 6, "groups", channels // inside)
        return LocalCall(local.target, largs, lkw, scale=local.scale)
    return lower


@register("aten.im2col.default")
def im2col(call: Call) -> Annotation:
    """``F.unfold`` / ``nn.Unfold`` (ConvBERT's span-based convolution): ``(N, C, H, W)`` to
    ``(N, C kh kw, L)``, the sliding windows' values per channel. The batch and the channels are
    spatial (channel ``c`` of the output dim ``(C kh kw)`` reads channel ``c`` alone: a part of
    the channels is a contiguous block of it); the kernel offsets and the positions are frozen
    (a window crosses the boundary of a part)."""
    x = call.shape(0, "self")
    (out,) = call.out_shapes
    batched = len(x) == 4
    lead = [(Factor("N", x[0]),)] if batched else []
    c = x[-3]
    kernel = out[-2] // c
    frozen = {"h0": "a window crosses the boundary of a part",
              "h1": "a window crosses the boundary of a part",
              "k": "the kernel offsets of a window", "L": "a window's position"}
    ins = (*lead, (Factor("C", c),), (Factor("h0", x[-2]),), (Factor("h1", x[-1]),))
    outs = (*lead, (Factor("C", c), Factor("k", kernel)), (Factor("L", out[-1]),))
    return Annotation((ins,), (outs,), frozen=frozen, windows=frozenset({"h0", "h1"}))


@register("aten.col2im.default")
def col2im(call: Call) -> Annotation:
    """``F.fold`` / ``nn.Fold`` (VOLO's outlook attention), the inverse of ``im2col``:
    ``(N, C kh kw, L)`` windows summed back into ``(N, C, H, W)``. The batch and the channels
    are spatial; the kernel offsets, the windows and the positions are whole (overlapping
    windows add into the same position)."""
    x = call.shape(0, "self")
    (out,) = call.out_shapes
    batched = len(x) == 3
    lead = [(Factor("N", x[0]),)] if batched else []
    c = out[-3]
    kernel = x[-2] // c
    why = "overlapping windows add into the same positions"
    frozen = {"h0": why, "h1": why, "k": "the kernel offsets of a window", "L": why}
    ins = (*lead, (Factor("C", c), Factor("k", kernel)), (Factor("L", x[-1]),))
    outs = (*lead, (Factor("C", c),), (Factor("h0", out[-2]),), (Factor("h1", out[-1]),))
    return Annotation((ins,), (outs,), frozen=frozen)


@register("aten.conv_transpose1d.default", "aten.conv_transpose2d.input",
          "aten.conv_transpose3d.input")
def conv_transpose(call: Call) -> Annotation:
    """A transposed convolution (a decoder's or a U-Net's learned upsampling): the batch split;
    with one group, the output channels split (the weight's second dim and the bias with them)
    and the input channels give partial sums, as a convolution's; the positions whole (each
    output position gathers from several input positions); grouped channels whole."""
    x, w = call.shape(0, "input"), call.shape(1, "weight")
    nsp = len(w) - 2
    groups = call.arg(6, "groups", 1)
    (out,) = call.out_shapes
    batched = len(x) == nsp + 2
    lead = [(Factor("N", x[0]),)] if batched else []
    why = "a transposed convolution's output positions gather from neighbouring inputs"
    frozen = {f"{p}{k}": why for k in range(nsp) for p in ("h", "o")}
    frozen.update({f"k{k}": "a kernel dim" for k in range(nsp)})
    x_sp = [(Factor(f"h{k}", x[-nsp + k]),) for k in range(nsp)]
    w_sp = [(Factor(f"k{k}", w[2 + k]),) for k in range(nsp)]
    o_sp = [(Factor(f"o{k}", out[-nsp + k]),) for k in range(nsp)]
    cin, cout = x[-nsp - 1], out[-nsp - 1]
    x_c, w_i, w_o, o_c = ((Factor("Ci", cin),), (Factor("Ci", cin),), (Factor("Co", w[1]),),
                          (Factor("Co", cout),))
    reduced = frozenset({"Ci"})
    if groups != 1:
        x_c = w_i = (Factor("Ci", cin),)
        w_o, o_c = (Factor("Cw", w[1]),), (Factor("Co", cout),)
        reduced = frozenset()
        frozen.update(Ci="grouped channels", Cw="grouped channels", Co="grouped channels")
    ins = [(*lead, x_c, *x_sp), (w_i, w_o, *w_sp)]
    if call.arg(2, "bias") is not None:
        ins.append((o_c,))
    return Annotation(tuple(ins), ((*lead, o_c, *o_sp),), reduced=reduced, frozen=frozen,
                      words=CHANNEL_WORDS, lower=_lower_conv,
                      windows=frozenset(f"h{k}" for k in range(nsp)))
