"""Pooling and batch normalization. Each example and each channel is pooled on its own: the
batch and channel dims are spatial. A pooling window spans neighbouring positions, so the pooled
dims are frozen, except in a global average pool (``adaptive_avg_pool2d`` to 1 x 1), which is a
mean over them: parts give partial sums, scaled by their share. Batch normalization in training
takes its statistics over the batch and the positions: only the channels split."""

from __future__ import annotations

from ssdsl.ops.build import dims, plain
from ssdsl.ops.core import Annotation, Call, Factor, Unsplittable, register
from ssdsl.ops.reduction import _mean_lower


def _split_sigs(shape, pooled: int):
    """Labels of the leading (independent) dims and of the ``pooled`` trailing dims."""
    lead = dims(len(shape) - pooled)
    return lead, [f"h{k}" for k in range(pooled)]


@register("aten.adaptive_avg_pool1d.default", "aten.adaptive_avg_pool2d.default",
          "aten.adaptive_avg_pool3d.default", "aten._adaptive_avg_pool2d.default")
def adaptive_avg_pool(call: Call) -> Annotation:
    (src,), (dst,) = call.in_shapes, call.out_shapes
    n = {"1d": 1, "2d": 2, "3d": 3}[call.op.target.split(".")[1][-2:]]
    lead, pooled = _split_sigs(src, n)
    ins = plain(lead + pooled, src)
    if all(s == 1 for s in dst[-n:]):  # global: a mean over the pooled dims
        outs = (*plain(lead, dst[:-n]), *((Factor(f"one{k}", 1),) for k in range(n)))
        return Annotation((ins,), (outs,), reduced=frozenset(pooled), lower=_mean_lower)
    outs = plain(lead + [f"o{k}" for k in range(n)], dst)
    frozen = {lab: "a pooling window spans neighbouring positions"
              for lab in (*pooled, *(f"o{k}" for k in range(n)))}
    return Annotation((ins,), (outs,), frozen=frozen, windows=frozenset(pooled))


@register("aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default",
          "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default",
          "aten.adaptive_max_pool1d.default", "aten.adaptive_max_pool2d.default",
          "aten.adaptive_max_pool3d.default")
def pool(call: Call) -> Annotation:
    (src,), outs_shapes = call.in_shapes, call.out_shapes
    n = int(call.op.target.split(".")[1][-2])
    lead, pooled = _split_sigs(src, n)
    outs = tuple(plain(lead + [f"o{k}" for k in range(n)], s) for s in outs_shapes)
    frozen = {lab: "a pooling window spans neighbouring positions"
              for lab in (*pooled, *(f"o{k}" for k in range(n)))}
    # each output position reads a window of the input's: the input positions are no dim of
    # the iteration space (``op_cost``: else a stem's max-pool weighs as its input times its
    # output positions, thousands of times its work)
    return Annotation((plain(lead + pooled, src),), outs, frozen=frozen,
                      windows=frozenset(pooled))


@register("aten.batch_norm.default")
def batch_norm(call: Call) -> Annotation:
    x = call.shape(0, "input")
    labels = dims(len(x))
    training = bool(call.arg(5, "training", False))
    why = "batch normalization takes its statistics over the batch and positions" if training \
        else None
    frozen = {lab: why for k, lab in enumerate(labels) if k != 1 and why}
    per_channel = ((Factor(labels[1], x[1]),),)
    ins = [plain(labels, x)] + [per_channel] * (len(call.op.inputs) - 1)
    return Annotation(tuple(ins), (plain(labels, x),), frozen=frozen)


_RESAMPLE = {f"aten.{name}.{overload}": n
             for name, n in (("upsample_nearest1d", 1), ("upsample_nearest2d", 2),
                             ("upsample_nearest3d", 3), ("_upsample_nearest_exact1d", 1),
                             ("_upsample_nearest_exact2d", 2), ("_upsample_nearest_exact3d", 3),
                             ("upsample_linear1d", 1), ("upsample_bilinear2d", 2),
                             ("upsample_bicubic2d", 2), ("upsample_trilinear3d", 3),
                             ("_upsample_bilinear2d_aa", 2))
             for overload in ("vec", "default")}


@register(*_RESAMPLE)
def resample(call: Call) -> Annotation:
    """``F.interpolate`` (nearest, linear, bilinear, bicubic, trilinear; a U-Net's or an FPN's
    upsampling): batch and channels split, the resampled positions whole (each output position
    reads neighbouring input positions)."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    n = _RESAMPLE[call.op.target]
    lead, pooled = _split_sigs(src, n)
    outs = plain(lead + [f"o{k}" for k in range(n)], dst)
    why = "resampling reads neighbouring positions"
    frozen = {lab: why for lab in (*pooled, *(f"o{k}" for k in range(n)))}
    return Annotation((plain(lead + pooled, src),), (outs,), frozen=frozen,
                      windows=frozenset(pooled))


@register("aten.grid_sampler.default", "aten.grid_sampler_2d.default",
          "aten.grid_sampler_3d.default")
def grid_sampler(call: Call) -> Annotation:
    """``F.grid_sample(x, grid)`` (a spatial transformer): each output position samples ``x``
    where its grid entry points, anywhere; batch, channels and the output positions (with the
    grid's) split, the input positions whole."""
    x, grid = call.in_shapes
    (out,) = call.out_shapes
    n = len(x) - 2
    if n < 1 or len(grid) != n + 2:
        raise Unsplittable(f"{call.op.kind} of input {tuple(x)} and grid {tuple(grid)}")
    pos, opos = [f"h{k}" for k in range(n)], [f"o{k}" for k in range(n)]
    why = "sampled anywhere, where the grid points"
    return Annotation((plain(["N", "C", *pos], x), plain(["N", *opos, "xy"], grid)),
                      (plain(["N", "C", *opos], out),),
                      frozen={**{p: why for p in pos}, "xy": "a grid entry's coordinates"},
                      windows=frozenset(pos))
