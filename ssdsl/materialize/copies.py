"""Values that need no batch, computed again on every pipeline stage that reads them.

A tied weight is the usual case: GPT-2's token embedding is read by the embedding on the first
stage and by the LM head on the last (through the tracer's ``share_`` alias, ``trace/shared.py``).
Planned as an edge, the alias's output crosses the pipeline in every micro-batch's forward and
its gradient comes back in every backward: for GPT-2 small at 8 micro-batches, 2 x 8 x 154 MB a
step, where Megatron sends nothing and sums the two copies' gradients once per step.

``copy_weight_reads`` does what Megatron does, as a rule on the graph: an operator that needs no
batch (it reads only parameters, buffers and constants, or the outputs of other such operators,
or nothing: ``arange``, a causal mask) and whose output a stage on other devices reads is
computed there too: a copy of the operator, with the same parts (index, regions, call), is put on
that stage right before its first reader there, one part per device, mapped in row-major order
onto the devices of that reader's parts, and the stage's readers read the copy. A parameter that
copies read on two stages is then held on the devices of both, in the same regions, and its
gradient is summed over them by the reducer once per step (``program._weights``: the devices of
each reading operator form a class of copies, and equal classes sum member by member), as a
data-parallel weight's is.

A random operator (dropout, ``rand``) is never copied (a copy would draw other numbers), nor one
that reads a weight sharded at ZeRO stage 3 (its holders gather it around each use, which the
lowering does within one stage), nor one whose copy would share a device with the original
(interleaved stages on one device: nothing crosses devices there), nor one whose reader has a
different number of parts (no one-to-one mapping onto its devices): those keep their edges,
which are correct, only dearer.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ssdsl.ir.batchfree import batch_free
from ssdsl.ir.graph import Op, TensorRef, map_tensor_refs
from ssdsl.materialize.fanout import _fresh
from ssdsl.transform.parts import Transformed, row_major

# False keeps every cross-stage read of such a value an edge (``bench/bench_peers.py --off``)
ENABLED = True


def copy_weight_reads(t: Transformed, keep: frozenset[str] = frozenset()) -> Transformed:
    """``t`` with the batch-free operators that later stages read on other devices copied onto
    those stages (see the module docstring); none that reads a parameter of ``keep`` (weights
    sharded at ZeRO stage 3, which their holders gather around each use, on one stage)."""
    if t.num_stages < 2 or not ENABLED:
        return t
    g = t.graph
    free = batch_free(g, keep)
    if not free:
        return t
    consumers = g.consumers()
    order = {op.name: i for i, op in enumerate(g.ops)}
    devices = {name: {p.device for p in t.parts[name]} for name in free}
    # (operator, stage) -> the original operator on that stage whose parts' devices the copy
    # takes (its first reader there, or the reader its copied reader took), decided from the
    # last operator backwards, so that a copied reader makes its producer's copy on its stage
    copies: dict[tuple[str, int], str] = {}
    anchor: dict[tuple[str, int], str] = {}  # where the copy goes: before this original op
    copied_on: dict[str, list[int]] = {}
    for name in sorted(free, key=order.__getitem__, reverse=True):
        op = g.op(name)
        own = t.stage(name)
        readers: dict[int, list[tuple[int, str, str]]] = {}  # stage -> (position, like, anchor)
        for x in op.outputs:
            for c in consumers.get(x, ()):
                s = t.stage(c.name)
                if s != own:
                    readers.setdefault(s, []).append((order[c.name], c.name, c.name))
                for s2 in copied_on.get(c.name, ()):
                    if s2 != own:
                        at = anchor[(c.name, s2)]
                        readers.setdefault(s2, []).append((order[at], copies[(c.name, s2)], at))
        for s, found in readers.items():
            _, like, at = min(found)
            mine, theirs = t.parts[name], t.parts[like]
            where = {p.device for p in theirs}
            if len(mine) != len(theirs) or len(where) != len(theirs) or devices[name] & where:
                continue
            copies[(name, s)] = like
            anchor[(name, s)] = at
            copied_on.setdefault(name, []).append(s)
    if not copies:
        return t
    return _insert(t, copies, anchor, order)


def _insert(t: Transformed, copies: Mapping[tuple[str, int], str],
            anchor: Mapping[tuple[str, int], str], order: Mapping[str, int]) -> Transformed:
    g = t.graph
    tensors = dict(g.tensors)
    taken = {op.name for op in g.ops} | set(tensors)
    parts, annotations, stage_of = dict(t.parts), dict(t.annotations), dict(t.stage_of)
    shapes, recompute = dict(t.shapes), dict(t.recompute)
    boxes = [dict(b) for b in t.boxes]
    renamed: dict[tuple[str, int], str] = {}  # (tensor, stage) -> the copy's tensor
    made: dict[tuple[str, int], Op] = {}
    for name, s in sorted(copies, key=lambda k: order[k[0]]):  # producers first
        op = g.op(name)
        new_name = _fresh(f"{name}_st{s}", taken)
        taken.add(new_name)
        outs = []
        for x in op.outputs:  # an output named as its operator keeps the copy's name
            y = new_name if x == name else _fresh(f"{x}_st{s}", taken)
            taken.add(y)
            tensors[y] = attrs.evolve(g.tensors[x], name=y)
            renamed[(x, s)] = y
            outs.append(y)
            if x in shapes:
                shapes[y] = shapes[x]
            for b in boxes:
                if x in b:
                    b[y] = b[x]
        made[(name, s)] = _rename(attrs.evolve(op, name=new_name, outputs=tuple(outs)),
                                  renamed, s)
        theirs = [p.device for p in row_major(list(t.parts[copies[(name, s)]]))]
        parts[new_name] = tuple(attrs.evolve(p, op=new_name, device=d)
                                for p, d in zip(row_major(list(t.parts[name])), theirs))
        annotations[new_name] = t.annotations[name]
        stage_of[new_name] = s
        at = anchor[(name, s)]
        if at in recompute:  # inside its first reader's recomputed run, not splitting it
            recompute[new_name] = recompute[at]
    before: dict[str, list[Op]] = {}
    for key in sorted(made, key=lambda k: order[k[0]]):
        before.setdefault(anchor[key], []).append(made[key])
    ops: list[Op] = []
    for op in g.ops:
        ops += before.get(op.name, [])
        ops.append(_rename(op, renamed, t.stage(op.name)))
    shown = sorted({name for name, _ in copies},
                   key=lambda n: (not set(g.op(n).inputs) & set(g.params), order[n]))
    notes = (*t.notes, f"{len(shown)} operator(s) that need no batch computed again on the "
             f"later stages that read them instead of sent there every micro-batch (e.g. "
             f"'{shown[0]}')")
    graph = attrs.evolve(g, ops=tuple(ops), tensors=tensors)
    return attrs.evolve(t, graph=graph, parts=parts, annotations=annotations, stage_of=stage_of,
                        shapes=shapes, boxes=tuple(boxes), recompute=recompute, notes=notes)


def _rename(op: Op, renamed: Mapping[tuple[str, int], str], stage: int) -> Op:
    """``op`` reading, on ``stage``, the copies made there of the tensors it reads."""
    if not any((x, stage) in renamed for x in op.inputs):
        return op

    def sub(ref: TensorRef) -> TensorRef:
        return TensorRef(renamed.get((ref.name, stage), ref.name))

    args = map_tensor_refs(op.args, sub)
    kwargs = tuple((k, map_tensor_refs(v, sub)) for k, v in op.kwargs)
    inputs = tuple(renamed.get((x, stage), x) for x in op.inputs)
    return attrs.evolve(op, args=args, kwargs=kwargs, inputs=inputs)
