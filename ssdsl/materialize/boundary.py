"""One message per value and receiving stage: the stage boundary read by several operators.

A value that crosses from one pipeline stage to a later one is often read there by more than
one operator input: a transformer block's residual stream feeds both its first layer norm and its
residual add. Planned edge by edge, each of those edges sends the value, and in backward each
sends its own gradient back: two messages each way per micro-batch where one suffices, since the
consumers read the same region on each device and their gradients are added anyway.

``gather_boundary_reads`` puts one identity operator (``aten.alias``, a view) on the receiving
stage, right before the first of those consumers, with one part per device of that stage reading
what the consumers read there; the consumers read the identity's output instead. So one edge
crosses the boundary (one send and one receive per micro-batch), the identity hands its output to
the consumers on the same device (nothing moves), and autograd adds the consumers' gradients on
the receiving device into the identity's output gradient, which the one backward edge sends back.

It applies to every group of two or more consumer slots of one produced tensor on one stage
other than the producer's, when on each device of that stage every slot reads the same region and
computes the same gradient value part (``Transformed.grad_value_part``): then the identity's
parts, copies of the first consumer's part indices, compute that same value part, and the sum
autograd takes on a device is that device's gradient of the region. A group that does not qualify
keeps its edges (correct, only more messages).

Consumers whose input gradients are partial sums do not qualify: tensor-parallel readers on the
later stage of a cut inside a block (LLaMA's k and v projections after a cut behind q, the gate
and up projections after one behind the attention). Each of their edges sums its own partials
(an all-reduce over the tensor-parallel group) into the identity's gradient, and two sums
delivered into one gradient kept only one of them: every earlier stage trained on wrong
gradients, which verification before launch refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ssdsl.ir.graph import Op, TensorRef
from ssdsl.materialize.fanout import FANOUT_PREFIX, _fresh, _reroute
from ssdsl.ops import SubOp, annotate
from ssdsl.transform.parts import Part, Transformed, whole_part

Slot = tuple[str, int]  # (consumer operator, input slot)

# False plans every reader's edge on its own (``bench/bench_peers.py --off boundary`` compares)
ENABLED = True


def gather_boundary_reads(t: Transformed) -> Transformed:
    """``t`` with an identity operator on each receiving stage of a cross-stage value that
    several consumer slots there read alike (see the module docstring)."""
    if t.num_stages < 2 or not ENABLED:
        return t
    g = t.graph
    producer = g.producer()
    groups: dict[tuple[str, int], list[Slot]] = {}
    for op in g.ops:
        for slot, name in enumerate(op.inputs):
            src = producer.get(name)
            if src is None or t.stage(op.name) == t.stage(src.name):
                continue
            if any(p.sub.inputs[slot] is not None for p in t.parts[op.name]):
                groups.setdefault((name, t.stage(op.name)), []).append((op.name, slot))
    chosen = {key: (slots, readers) for key, slots in groups.items() if len(slots) >= 2
              and (readers := _alike(t, slots)) is not None}
    return _insert(t, chosen) if chosen else t


def _alike(t: Transformed, slots: list[Slot]) -> dict[int, Part] | None:
    """Per device, the first slot's part there, when every slot is read on the same devices,
    with one part per device, the same region and the same gradient value part; else None."""
    first: dict[int, Part] = {}
    seen: dict[int, tuple] = {}
    for op, slot in slots:
        here: dict[int, tuple] = {}
        for p in t.parts[op]:
            region = p.sub.inputs[slot]
            if region is None or p.device is None or p.device in here:
                return None
            value_part = t.grad_value_part(p, slot)
            if value_part[1] > 1:  # a partial sum (tensor-parallel readers): module doc
                return None
            here[p.device] = (region, value_part)
            first.setdefault(p.device, p)
        if seen and here != seen:
            return None
        seen = here
    return first


def _insert(t: Transformed, chosen: Mapping[tuple[str, int], tuple[list[Slot], dict[int, Part]]]
            ) -> Transformed:
    g = t.graph
    tensors = dict(g.tensors)
    taken = {op.name for op in g.ops} | set(tensors)
    before: dict[str, list[Op]] = {}
    rename: dict[Slot, str] = {}
    parts, annotations, stage_of = dict(t.parts), dict(t.annotations), dict(t.stage_of)
    shapes, recompute = dict(t.shapes), dict(t.recompute)
    boxes = [dict(b) for b in t.boxes]
    order = {op.name: i for i, op in enumerate(g.ops)}
    for (name, stage), (slots, readers) in chosen.items():
        new = _fresh(f"{FANOUT_PREFIX}{name}_s{stage}", taken)
        taken.add(new)
        tensors[new] = attrs.evolve(g.tensors[name], name=new)
        head = min((op for op, _ in slots), key=order.__getitem__)
        op = Op(name=new, target="aten.alias.default", kind="alias", module=g.op(head).module,
                args=(TensorRef(name),), inputs=(name,), outputs=(new,), calls=g.op(head).calls)
        ann = annotate(attrs.evolve(g, tensors=tensors), op)
        local = whole_part(attrs.evolve(g, tensors=tensors), op, ann).local
        parts[new] = tuple(
            Part(new, p.index, p.replica, (), SubOp((p.sub.inputs[slot],), (p.sub.inputs[slot],),
                                                    (), local), d, p.span, p.assigned_at)
            for d, p in readers.items()
            for slot in (dict(slots)[p.op],))
        annotations[new] = ann
        stage_of[new] = stage
        if head in recompute:  # inside the head's recomputed run, not splitting it
            recompute[new] = recompute[head]
        if name in shapes:  # one micro-batch's shape and boxes, as the value it is
            shapes[new] = shapes[name]
        for b in boxes:
            if name in b:
                b[new] = b[name]
        before.setdefault(head, []).append(op)
        rename.update({s: new for s in slots})
    ops: list[Op] = []
    for op in g.ops:
        ops += before.get(op.name, [])
        ops.append(_reroute(op, rename))
    graph = attrs.evolve(g, ops=tuple(ops), tensors=tensors)
    return attrs.evolve(t, graph=graph, parts=parts, annotations=annotations, stage_of=stage_of,
                        shapes=shapes, boxes=tuple(boxes), recompute=recompute)
