"""One sum for the partial input gradients of several consumers (Megatron's ``f`` operator).

Megatron's column-parallel group reads one replicated activation with several linears (LLaMA's
q, k and v projections; its gate and up projections). Each linear's input gradient is a partial
sum on each device, and planned edge by edge, each edge's backward all-reduces its own partial:
three all-reduces where one suffices, because the gradients of the edges are added anyway.

``gather_fanouts`` puts one identity operator (``aten.alias``, a view) between the replicated
producer and the consumers whose gradients are partial, on the producer's devices. Autograd adds
the consumers' partials on each device into the identity's output gradient, and the identity is
a replica whose partial output gradients qualify for ``partial_gradient_replicas``: its backward
passes the local sum on, and the edge from the producer to the identity all-reduces it once.
Forward is unchanged (the identity reads and gives the replicated tensor on the same devices).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ssdsl.ir.graph import Graph, Op, TensorRef, map_tensor_refs
from ssdsl.ops import annotate
from ssdsl.transform.parts import Part, Transformed, whole_part

FANOUT_PREFIX = "fanout_"


def gather_fanouts(t: Transformed) -> Transformed:
    """``t`` with an identity operator before every group of two or more consumer slots of one
    replicated tensor whose input gradients are the same partial sums on each device."""
    g = t.graph
    producer = g.producer()
    groups: dict[str, list[tuple[str, int]]] = {}
    for op in g.ops:
        for slot, name in enumerate(op.inputs):
            if name in producer and _float(g, name) and _partial_slot(t, op.name, slot):
                groups.setdefault(name, []).append((op.name, slot))
    chosen = {name: slots for name, slots in groups.items()
              if _replicated(t, producer[name].name) and _same_partials(t, slots)
              and len(slots) >= 2}
    if not chosen:
        return t
    return _insert(t, chosen, producer)


def _float(g: Graph, name: str) -> bool:
    dtype = g.tensors[name].dtype
    return "float" in dtype or "complex" in dtype


def _partial_slot(t: Transformed, op: str, slot: int) -> bool:
    return all(t.grad_value_part(p, slot)[1] > 1 for p in t.parts[op]
               if p.sub.inputs[slot] is not None)


def _replicated(t: Transformed, op: str) -> bool:
    """Replicas of one part, one per device (every device holds the whole output)."""
    parts = t.parts[op]
    devices = [p.device for p in parts]
    return (len(parts) > 1 and len({p.partition_index for p in parts}) == 1
            and None not in devices and len(set(devices)) == len(devices))


def _same_partials(t: Transformed, slots: list[tuple[str, int]]) -> bool:
    """Every slot gives, on each device, the same partial index ``(k, V)``: their sum on a
    device is that device's partial of the whole gradient."""
    per_device: dict[int, tuple[int, int]] = {}
    for op, slot in slots:
        for p in t.parts[op]:
            if p.sub.inputs[slot] is None:
                continue
            if per_device.setdefault(p.device, t.grad_value_part(p, slot)) != \
                    t.grad_value_part(p, slot):
                return False
    return True


def _insert(t: Transformed, chosen: Mapping[str, list[tuple[str, int]]],
            producer: Mapping[str, Op]) -> Transformed:
    g = t.graph
    tensors = dict(g.tensors)
    taken = {op.name for op in g.ops}
    after: dict[str, list[Op]] = {}
    rename: dict[tuple[str, int], str] = {}
    parts = dict(t.parts)
    annotations = dict(t.annotations)
    for name, slots in chosen.items():
        src = producer[name]
        new = _fresh(f"{FANOUT_PREFIX}{name}", taken | set(tensors))
        taken.add(new)
        tensors[new] = attrs.evolve(g.tensors[name], name=new)
        op = Op(name=new, target="aten.alias.default", kind="alias", module=src.module,
                args=(TensorRef(name),), inputs=(name,), outputs=(new,))
        after.setdefault(src.name, []).append(op)
        rename.update({s: new for s in slots})
        graph_now = attrs.evolve(g, tensors=tensors)
        ann = annotate(graph_now, op)
        sub = whole_part(graph_now, op, ann)
        annotations[new] = ann
        parts[new] = tuple(Part(new, p.index, p.replica, (), sub, p.device, p.span,
                                p.assigned_at) for p in t.parts[src.name])
    ops: list[Op] = []
    for op in g.ops:
        ops.append(_reroute(op, rename))
        ops += after.get(op.name, [])
    graph = attrs.evolve(g, ops=tuple(ops), tensors=tensors)
    stage_of = dict(t.stage_of)
    for src, extra in after.items():
        if src in stage_of:
            stage_of.update({op.name: stage_of[src] for op in extra})
    return attrs.evolve(t, graph=graph, parts=parts, annotations=annotations, stage_of=stage_of)


def _reroute(op: Op, rename: Mapping[tuple[str, int], str]) -> Op:
    mine = {slot: new for (name, slot), new in rename.items() if name == op.name}
    if not mine:
        return op
    slots = iter(range(len(op.inputs)))

    def sub(ref: TensorRef) -> TensorRef:
        slot = next(slots)
        return TensorRef(mine.get(slot, ref.name))

    args = map_tensor_refs(op.args, sub)
    kwargs = tuple((k, map_tensor_refs(v, sub)) for k, v in op.kwargs)
    inputs = tuple(mine.get(i, n) for i, n in enumerate(op.inputs))
    return attrs.evolve(op, args=args, kwargs=kwargs, inputs=inputs)


def _fresh(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name
