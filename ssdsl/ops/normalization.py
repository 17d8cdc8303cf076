"""Normalization: the normalized dims are frozen (statistics need the whole dim); the others,
batch and sequence, are spatial."""

from __future__ import annotations

from ssdsl.ops.build import dims, plain
from ssdsl.ops.core import Annotation, Call, Factor, register


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
    x = call.shape(0, "input")
    labels = dims(len(x))
    frozen = {lab: "normalized over" for lab in labels[1:]}
    affine = ((Factor(labels[1], x[1]),),)
    ins = [plain(labels, x)] + [affine] * (len(call.op.inputs) - 1)
    return Annotation(tuple(ins), (plain(labels, x),), frozen=frozen)
