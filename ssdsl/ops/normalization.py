"""Normalization: the normalized dims are frozen (statistics need the whole dim); the others,
batch and sequence, are spatial."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ssdsl.ops.build import dims, extent, plain, set_arg
from ssdsl.ops.core import Annotation, Call, Factor, Interval, LocalCall, by_extent, register


@register("aten.layer_norm.default", "aten.rms_norm.default")
def layer_norm(call: Call) -> Annotation:
    x = call.shape(0, "input")
    normalized = tuple(call.arg(1, "normalized_shape"))
    n = len(normalized)
    labels = dims(len(x))
    frozen = {lab: "normalized over" for lab in labels[len(x) - n:]}
    affine = plain(labels[len(x) - n:], normalized)
    ins = [plain(labels, x)] + [affine] * (len(call.op.inputs) - 1)
    return Annotation(tuple(ins), (plain(labels, x),), frozen=frozen)


@register("aten.group_norm.default")
def group_norm(call: Call) -> Annotation:
    """The channel dim is ``(groups, channels per group)``: statistics are per example and per
    group, so the batch and the groups may be split (a part normalizes its own groups, with
    ``num_groups`` its share); the channels inside a group and the spatial dims are frozen. A
    split of the outer factor is a contiguous block of channels, so a convolution split by its
    output channels feeds its norm without communication."""
    x = call.shape(0, "input")
    groups = int(call.arg(1, "num_groups"))
    labels = dims(len(x))
    frozen = {lab: "normalized over" for lab in labels[2:]}
    if len(x) < 2 or groups <= 1 or x[1] % groups:
        frozen[labels[1]] = "normalized over"
        channel: tuple[Factor, ...] = (Factor(labels[1], x[1] if len(x) > 1 else 1),)
    else:
        g, c = f"{labels[1]}.0", f"{labels[1]}.1"
        frozen[c] = "normalized over (the channels of one group)"
        channel = (Factor(g, groups), Factor(c, x[1] // groups))
    sig = ((Factor(labels[0], x[0]),), channel, *plain(labels[2:], x[2:]))
    ins = [sig] + [(channel,)] * (len(call.op.inputs) - 1)
    return Annotation(tuple(ins), (sig,), frozen=frozen, lower=_local_groups)


@by_extent
def _local_groups(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
                  kwargs: dict) -> LocalCall:
    """A part holding some of the groups normalizes that many groups."""
    channel = ann.inputs[0][1]
    if len(channel) < 2:  # not cut into groups: the whole channel dim, unchanged
        return LocalCall(call.op.target, args, tuple(kwargs.items()))
    held = math.prod(extent(f, ranges) for f in channel)
    args, kw = set_arg(args, kwargs, 1, "num_groups", held // channel[-1].size)
    return LocalCall(call.op.target, args, kw)


@register("aten._weight_norm.default")
def weight_norm(call: Call) -> Annotation:
    """``_weight_norm(v, g, dim)`` (``nn.utils.parametrizations.weight_norm``: Wav2Vec2's
    positional conv): ``g * v / ||v||``, the norm taken for each index of ``dim`` over every
    other dim, so ``dim`` may be split (``g`` holds one scale per index of it) and the other
    dims are frozen; ``dim=-1`` takes one norm over the whole tensor."""
    v, g = call.shape(0, "v"), call.shape(1, "g")
    d = call.arg(2, "dim", 0)
    labels = dims(len(v))
    kept = None if d == -1 else (d + len(v) if d < 0 else d)
    frozen = {lab: "weight norm takes its norm over it" for k, lab in enumerate(labels)
              if k != kept}
    if kept is not None and len(g) == len(v):
        g_sig = tuple((Factor(labels[k] if k == kept else f"one{k}", s),)
                      for k, s in enumerate(g))
    else:
        g_sig = plain([f"one{k}" for k in range(len(g))], g)
        frozen.update({f"one{k}": "weight norm's scale" for k in range(len(g))})
    return Annotation((plain(labels, v), g_sig), (plain(labels, v),), frozen=frozen)


@register("aten.instance_norm.default")
def instance_norm(call: Call) -> Annotation:
    """``F.instance_norm``: each sample's channel normalized over its positions; batch and
    channels split (the weight, bias and running statistics per channel with them), positions
    whole. Running statistics updated in training average over the batch: then the batch is
    whole too."""
    x = call.shape(0, "input")
    labels = dims(len(x))
    why = "instance normalization takes its statistics over the positions"
    frozen = {lab: why for lab in labels[2:]}
    tracks = call.arg(3, "running_mean") is not None and bool(call.arg(5, "use_input_stats"))
    if tracks:
        frozen[labels[0]] = "the running statistics average over the batch"
    per_channel = ((Factor(labels[1], x[1]),),)
    ins = [plain(labels, x)] + [per_channel] * (len(call.op.inputs) - 1)
    return Annotation(tuple(ins), (plain(labels, x),), frozen=frozen)
