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

The same holds for consumers that read one *slice* of a replicated tensor, the same slice on each
device (under sequence parallelism, a block's layer norm and its residual add both read the
embeddings' sequence part): planned edge by edge, each edge's backward all-gathers its own
slice's gradient. One identity part per device, reading that device's slice, takes their place:
autograd adds the consumers' gradients on the slice, and one edge gathers the sum.
"""

from __future__ import annotations

from collections.abc import Mapping

import math

import attrs

from ssdsl.ir.graph import Graph, Op, TensorRef, map_tensor_refs
from ssdsl.ops import Annotation, annotate, call_of
from ssdsl.transform.parts import Part, Regions, Transformed, whole_part

FANOUT_PREFIX = "fanout_"


def gather_fanouts(t: Transformed) -> Transformed:
    """``t`` with an identity operator before every group of two or more consumer slots of one
    replicated tensor whose input gradients are the same partial sums on each device."""
    g = t.graph
    producer = g.producer()
    groups: dict[str, list[tuple[str, int]]] = {}
    sliced: dict[str, list[tuple[str, int]]] = {}
    for op in g.ops:
        for slot, name in enumerate(op.inputs):
            if name in producer and _float(g, name):
                into = groups if _partial_slot(t, op.name, slot) else sliced
                into.setdefault(name, []).append((op.name, slot))
    chosen: dict[str, tuple[list[tuple[str, int]], dict[int, Part] | None]] = {
        name: (slots, None) for name, slots in groups.items()
        if _replicated(t, producer[name].name) and _same_partials(t, slots) and len(slots) >= 2}
    for name, slots in sliced.items():
        if name not in chosen and len(slots) >= 2 and _replicated(t, producer[name].name):
            readers = _same_slice(t, name, slots)
            if readers is not None:
                chosen[name] = (slots, readers)
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


def _same_slice(t: Transformed, name: str, slots: list[tuple[str, int]]
                ) -> dict[int, tuple[Part, Regions]] | None:
    """For consumer slots of ``name`` that read, on each device, one and the same slice (full
    values, one interval per dim, not the whole tensor everywhere): per device, the first
    slot's part there and the slice. None when the slots do not qualify."""
    first: dict[int, Part] = {}
    region: dict[int, tuple] = {}
    for op, slot in slots:
        seen: set[int] = set()
        for p in t.parts[op]:
            r = p.sub.inputs[slot]
            if r is None:
                continue
            if p.device is None or p.device in seen or t.grad_value_part(p, slot)[1] != 1:
                return None
            seen.add(p.device)
            if any(len(ivs) != 1 for ivs in r) or region.setdefault(p.device, r) != r:
                return None
            first.setdefault(p.device, p)
        if seen != set(region):
            return None
    whole = tuple(((0, n),) for n in t.graph.tensors[name].shape)
    if all(r == whole for r in region.values()):
        return None  # nothing to gather in backward
    return {d: (first[d], region[d]) for d in sorted(first)}


def _slice_ranges(ann, region: Regions) -> dict[str, tuple[int, int]] | None:
    """The identity's label ranges that cover ``region`` (None: the annotation cannot say that
    slice, e.g. a part of a dim made of several factors)."""
    if not isinstance(ann, Annotation):
        return None
    ranges: dict[str, tuple[int, int]] = {}
    for dim, ((start, stop),) in zip(ann.inputs[0], region):
        if len(dim) != 1:
            if (start, stop) != (0, math.prod(f.size for f in dim)):
                return None
        elif (start, stop) != (0, dim[0].size):
            ranges[dim[0].label] = (start, stop)
    return ranges


def _insert(t: Transformed, chosen: Mapping[str, tuple[list[tuple[str, int]],
                                                       dict[int, Part] | None]],
            producer: Mapping[str, Op]) -> Transformed:
    g = t.graph
    tensors = dict(g.tensors)
    taken = {op.name for op in g.ops}
    after: dict[str, list[Op]] = {}
    rename: dict[tuple[str, int], str] = {}
    parts = dict(t.parts)
    annotations = dict(t.annotations)
    for name, (slots, readers) in chosen.items():
        src = producer[name]
        new = _fresh(f"{FANOUT_PREFIX}{name}", taken | set(tensors))
        taken.add(new)
        tensors[new] = attrs.evolve(g.tensors[name], name=new)
        op = Op(name=new, target="aten.alias.default", kind="alias", module=src.module,
                args=(TensorRef(name),), inputs=(name,), outputs=(new,))
        graph_now = attrs.evolve(g, tensors=tensors)
        ann = annotate(graph_now, op)
        if readers is None:
            sub = whole_part(graph_now, op, ann)
            made = tuple(Part(new, p.index, p.replica, (), sub, p.device, p.span,
                              p.assigned_at) for p in t.parts[src.name])
        else:
            ranges = {d: _slice_ranges(ann, r) for d, (_, r) in readers.items()}
            subs = {d: ann.partition(call_of(graph_now, op), r) for d, r in ranges.items()
                    if r is not None}
            if len(subs) != len(readers) or any(
                    subs[d].inputs[0] != r for d, (_, r) in readers.items()):
                del tensors[new]
                continue
            made = tuple(Part(new, p.index, p.replica, tuple(ranges[d].items()), subs[d], d,
                              p.span, p.assigned_at) for d, (p, _) in readers.items())
        after.setdefault(src.name, []).append(op)
        rename.update({s: new for s in slots})
        annotations[new] = ann
        parts[new] = made
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
