"""Padding (``F.pad``, constant, reflect, replicate or circular): a dim padded on either side is
made by the operator (its extent changes, and a reflection reads across it), so it cannot be
split; every other dim passes through and can be split (a reflect-padded image's batch and
channels: TResNet's stem)."""

from __future__ import annotations

from ssdsl.ops.build import dims, plain
from ssdsl.ops.core import Annotation, Call, Factor, register


@register("aten.pad.default", "aten.constant_pad_nd.default")
def pad(call: Call) -> Annotation:
    (shape,) = call.in_shapes
    (out_shape,) = call.out_shapes
    widths = list(call.arg(1, "pad"))
    mode = call.arg(2, "mode", "constant") if call.op.target == "aten.pad.default" else "constant"
    why = "padding changes the extent of this dim" if mode == "constant" else \
        f"padding ({mode}) changes the extent of this dim and reads across it"
    labels = dims(len(shape))
    padded = {len(shape) - 1 - i // 2 for i, w in enumerate(widths) if w}
    ins, outs, frozen = [], [], {}
    for d, (lab, s, o) in enumerate(zip(labels, shape, out_shape)):
        if d in padded:
            ins.append((Factor(f"{lab}_in", s),))
            outs.append((Factor(lab, o),))
            frozen[lab] = frozen[f"{lab}_in"] = why
        else:
            ins.append((Factor(lab, s),))
            outs.append((Factor(lab, o),))
    return Annotation((tuple(ins),), (tuple(outs),), frozen=frozen)


__all__ = ["pad", "plain"]
