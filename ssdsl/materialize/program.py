"""From placed parts to communication: one adapter per data edge, and the weight reducers.

For every operator input that another operator produces, the producers' parts and the consumer's
parts give the adapter (``plan_adapter``): regions and value parts of the producers, regions the
consumers read, and the gradient placements that say which consumers' input gradients are partial
sums (``Transformed.grad_value_part``). Graph inputs, parameters, buffers and constants are
*sources*: every rank has them (the batch from ``get_batch``, weights from the seeded model) and
takes its regions locally, so they need no adapter. Parameter gradients are summed over the
devices that hold the same region by the reducer; a part that is one of R replicas contributes
1/R of its gradient, so that copies are not counted R times.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from ssdsl.elaborate.directives import Zero
from ssdsl.errors import SsdslError
from ssdsl.gcpause import gc_paused
from ssdsl.ir.grad import loss_grad_tensors
from ssdsl.ir.region import Region
from ssdsl.materialize.boundary import gather_boundary_reads
from ssdsl.materialize.copies import copy_weight_reads
from ssdsl.materialize.fanout import gather_fanouts
from ssdsl.materialize.plan import plan_adapter
from ssdsl.materialize.reducer import (GradReducer, Weight, ZeroSpec, holder_pieces,
                                       module_unit, plan_grad_reducer)
from ssdsl.materialize.steps import Adapter
from ssdsl.transform.errors import UnsupportedDirective
from ssdsl.transform.parts import Part, Transformed
from ssdsl.transform.select import select_ops


class UnsupportedPlacement(SsdslError):
    """A placement this runtime does not execute yet (several parts of one operator on a device
    of a pipeline: micro-batches or stages)."""


@attrs.frozen
class Edge:
    """The adapter that feeds input ``slot`` of operator ``op`` with tensor ``tensor``."""

    tensor: str
    op: str
    slot: int
    adapter: Adapter


@attrs.frozen
class SourceUse:
    """A part reads ``region`` of source tensor ``tensor``; its gradient counts ``scale`` times."""

    tensor: str
    region: Region
    scale: float


@attrs.frozen
class Materialized:
    """Everything the per-rank programs need besides the parts: edges, source uses, reducer."""

    transformed: Transformed
    edges: Mapping[tuple[str, str, int], Edge] = attrs.field(converter=MappingProxyType)
    # (tensor, op, slot, device, part index): a device may hold several parts of one operator
    sources: Mapping[tuple[str, str, int, int, tuple[int, ...]], SourceUse] = attrs.field(
        converter=MappingProxyType)
    reducer: GradReducer
    dtype: torch.dtype
    # The pipeline schedule (an ``ssdsl.schedule.lower.Lowered``), None for one stage.
    schedule: Any = None
    # Whether a rank's last backward may send its gradients before computing the weights'
    # (``ssdsl.lower.build._RankLowering._sent_first``): a second walk a device that would wait
    # does for free. False where the ranks share cores (``ssdsl.runtime.host``): there the
    # second walk takes a core another rank needs. The job decides (``JobSpec.send_first``)
    # once, before any program is lowered, so that every rank and the checker lower alike.
    # Where the lowering can split that backward in halves instead (``_split_last``: no work
    # added), it does so whatever this says.
    send_first: bool = True

    def part_on(self, op: str, device: int) -> Part | None:
        """The first part of ``op`` on ``device`` (co-shard puts several there)."""
        for p in self.transformed.parts[op]:
            if p.device == device:
                return p
        return None

    def parts_on(self, op: str, device: int) -> tuple[Part, ...]:
        """The parts of ``op`` on ``device``, in row-major order: the order of that device's
        slots in every adapter of ``op``'s outputs, and the order in which they run."""
        return tuple(p for p in self.transformed.parts[op] if p.device == device)

    def accounting(self) -> dict[str, Any]:
        """Collectives per step: ``{kind: {"count": n, "bytes": b}}``, forward, backward, reducer."""
        table: dict[str, dict[str, dict[str, int]]] = {"forward": {}, "backward": {},
                                                        "gradients": {}}
        times = self.transformed.microbatches  # every micro-batch runs every edge's adapter
        for e in self.edges.values():
            _add(table["forward"], e.adapter.accounting(), times)
            if e.adapter.backward is not None:
                _add(table["backward"], e.adapter.backward.accounting(), times)
        _add(table["gradients"], self.reducer.accounting())
        total = sum(v["bytes"] for section in table.values() for v in section.values())
        return {**table, "total_bytes": total}


def _add(into: dict[str, dict[str, int]], acc: Mapping[str, tuple[int, int]],
         times: int = 1) -> None:
    for kind, (count, nbytes) in acc.items():
        if not count and not nbytes:  # a local step (a chunk of what a device holds) moves nothing
            continue
        slot = into.setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += count * times
        slot["bytes"] += nbytes * times


def source_names(t: Transformed) -> set[str]:
    g = t.graph
    return {*g.inputs, *g.params, *g.buffers, *g.constants}


@gc_paused()
def materialize(t: Transformed, *, dtype: torch.dtype = torch.float32,
                schedule: Any = None, send_first: bool = True) -> Materialized:
    """Adapters for every produced tensor's uses, source uses, and the weight-gradient reducer.

    With micro-batches, ``t``'s parts are one micro-batch's (local coordinates): the adapters are
    planned once and every micro-batch runs them. ``schedule`` is passed through to the runtime,
    ``send_first`` to the lowering (``Materialized.send_first``).
    """
    if schedule is None:
        t = gather_fanouts(t)
    else:  # a stage-3 weight is gathered around its uses by its holders: one stage holds it
        sharded = frozenset(w for z in zero_specs(t) if z.stage == 3 for w in z.weights)
        t = gather_boundary_reads(copy_weight_reads(t, keep=sharded))
    _check_one_part_per_device(t, schedule)
    g = t.graph
    sources = source_names(t)
    producer = g.producer()
    partial = partial_gradient_replicas(t)
    # no gradient adapter for a tensor that needs no gradient: no rank would send one
    needs_grad = loss_grad_tensors(g)
    traced = traced_dtype(g)
    edges: dict[tuple[str, str, int], Edge] = {}
    reads: dict[tuple[str, str, int, int, tuple[int, ...]], Part] = {}
    for op in g.ops:
        for slot, name in enumerate(op.inputs):
            readers = [p for p in t.parts[op.name] if p.sub.inputs[slot] is not None]
            if name in sources:
                for p in readers:
                    reads[(name, op.name, slot, p.device, p.index)] = p
                continue
            if not readers:  # only its shape is used (view_as's other): nothing moves
                continue
            edges[(name, op.name, slot)] = Edge(name, op.name, slot,
                                                _edge_adapter(t, producer[name], name, readers,
                                                              slot, dtype, partial, traced,
                                                              backward=name in needs_grad))
    weights, scales = _weights(t, reads, dtype, partial)
    uses = {key: SourceUse(key[0], _region(t, key[0], p.sub.inputs[key[2]]), scales.get(key, 1.0))
            for key, p in reads.items()}
    _check_sliced_zero(t, weights)
    reducer = plan_grad_reducer(weights, zero=zero_specs(t), gathers=2 * t.microbatches)
    _check_zero3(t, reducer, schedule)
    reducer = _keep_over(t, reducer, schedule)
    return Materialized(t, edges, uses, reducer, dtype, schedule, send_first)


class SlicedZero(SsdslError):
    """``zero`` over a weight whose copies hold overlapping but unequal regions: its gradient is
    reduced piece by piece, as slices of larger leaves, which a ZeRO shard cannot be."""


def _check_sliced_zero(t: Transformed, weights: list[Weight]) -> None:
    """Refuse, at its line, a ``zero`` that would shard a piece of a weight summed piece by
    piece (``_piece_weights``)."""
    for z in zero_specs(t):
        for w in weights:
            devs = {d for d, _ in w.placements}
            if w.sliced and len(devs) > 1 and w.name in z.weights and devs <= z.devices:
                qual = t.graph.params.get(w.name, w.name)
                raise SlicedZero(
                    f"zero over devices {sorted(z.devices)}: the copies of {qual} hold "
                    "overlapping but unequal regions (a partition nested in one part), whose "
                    "gradients are summed piece by piece; ZeRO cannot shard those pieces",
                    z.span, hint="leave this weight out of `zero` (`zero (all except ...) "
                    "over ...`), or partition every part alike so that its copies hold equal "
                    "regions")


def zero_specs(t: Transformed) -> tuple[ZeroSpec, ...]:
    """The plan's ``zero`` statements, each resolved to the parameters its operators read."""
    g = t.graph
    out = []
    for d in t.deferred:
        if isinstance(d, Zero):
            ops = set(select_ops(g, d.selector, d.span))
            weights = frozenset(n for op in g.ops if op.name in ops for n in op.inputs
                                if n in g.params)
            out.append(ZeroSpec(weights, frozenset(d.devices), d.stage, d.span))
    return tuple(out)


def _region(t: Transformed, tensor: str, intervals, part: tuple[int, int] = (0, 1)) -> Region:
    return t.region(tensor, intervals, part)


def _torch_dtype(name: str) -> torch.dtype | None:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def traced_dtype(graph) -> torch.dtype | None:
    """The floating dtype the model was traced in: its parameters' (the most common one)."""
    counts: dict[torch.dtype, int] = {}
    for name in graph.params:
        d = _torch_dtype(graph.tensors[name].dtype) if name in graph.tensors else None
        if d is not None and d.is_floating_point:
            counts[d] = counts.get(d, 0) + 1
    return max(counts, key=counts.get) if counts else None


def _edge_adapter(t: Transformed, producer_op, tensor: str, readers: list[Part], slot: int,
                  dtype: torch.dtype, partial: Mapping[str, Mapping[int, tuple[int, int]]],
                  traced: torch.dtype | None, *, backward: bool = True) -> Adapter:
    j = producer_op.outputs.index(tensor)
    sizes = t.label_sizes(producer_op.name)
    parts = t.parts[producer_op.name]
    producers = [(p.device, _region(t, tensor, p.sub.outputs[j], p.value_part(sizes)))
                 for p in parts]
    consumers = [(c.device, _region(t, tensor, c.sub.inputs[slot])) for c in readers]
    grads = [(c.device, _region(t, tensor, c.sub.inputs[slot], _grad_part(t, c, slot, partial)))
             for c in readers]
    grad_producers = None
    if producer_op.name in partial:
        # replicas that take their device's partial gradient as it is (no sum here)
        grad_producers = [(p.device, _region(t, tensor, p.sub.outputs[j],
                                             partial[producer_op.name][p.device])) for p in parts]
    # Integer tensors (token ids, targets) cross devices as they are; floats of the traced
    # precision in the run's dtype (a graph traced in float32 serves a float64 run); a float
    # the model keeps in another precision (rotary tables in float32) as it is.
    declared = _torch_dtype(t.graph.tensors[tensor].dtype)
    if declared is not None and (not declared.is_floating_point
                                 or declared != traced):
        dtype = declared
    return plan_adapter(t.shape(tensor), dtype, producers, consumers, grad_consumers=grads,
                        grad_producers=grad_producers, backward=backward)


def _grad_part(t: Transformed, part: Part, slot: int,
               partial: Mapping[str, Mapping[int, tuple[int, int]]]) -> tuple[int, int]:
    """``(k, V)`` of the gradient ``part`` computes for input ``slot``."""
    if part.op in partial:
        return partial[part.op][part.device]
    return t.grad_value_part(part, slot)


def partial_gradient_replicas(t: Transformed) -> dict[str, dict[int, tuple[int, int]]]:
    """Replicated operators whose backward can run on partial output gradients, per device.

    Backward is linear in the output gradient, so a replica fed the k-th of V partial gradients
    computes the k-th partial of its input gradients: the sum can wait until the weights (the
    reducer) instead of being taken on the activation. Under ``dp``, the position embedding has
    no batch dim and is replicated; its output gradient is a partial sum on each device, and this
    saves the all-reduce of that activation gradient: the weight's gradient, reduced anyway,
    carries the sum. An operator qualifies when its parts are replicas of one part, one per
    device, no output is the loss, and every consumer of its outputs gives, on each device, the
    same partial index (k of V) with V > 1 and every k present (decided from the loss backwards),
    and every floating input it reads is a source or the output of another such operator.
    """
    consumers = t.graph.consumers()
    producer = t.graph.producer()
    allowed = {op.name for op in t.graph.ops}
    while True:
        found = _partial_pass(t, consumers, allowed)
        # Worth it where the partial gradients end at weights, or where several consumers'
        # sums become one: an input gradient that another (non-qualifying) operator needs whole
        # moves the sum upstream, which pays only when fewer sums are taken there.
        bad = {name for name in found
               if 0 < _sums_upstream(t, name, producer, found) >= _partial_slots(t, name)}
        if not bad:
            return found
        allowed -= bad


def _sums_upstream(t: Transformed, name: str, producer, found) -> int:
    """How many float inputs of ``name`` come from operators that need their gradient whole."""
    return sum(1 for inp in t.graph.op(name).inputs
               if inp in producer and _is_float(t, inp) and producer[inp].name not in found)


def _partial_slots(t: Transformed, name: str) -> int:
    """How many consumer slots read the outputs of ``name`` (each would take its own sum)."""
    outs = set(t.graph.op(name).outputs)
    return sum(1 for op in t.graph.ops for inp in op.inputs if inp in outs)


def _is_float(t: Transformed, tensor: str) -> bool:
    return "float" in t.graph.tensors[tensor].dtype or "complex" in t.graph.tensors[tensor].dtype


def _partial_pass(t: Transformed, consumers, allowed: set[str]
                  ) -> dict[str, dict[int, tuple[int, int]]]:
    found: dict[str, dict[int, tuple[int, int]]] = {}
    for op in reversed(t.graph.ops):
        if op.name not in allowed:
            continue
        parts = t.parts[op.name]
        devices = [p.device for p in parts]
        if (len(parts) < 2 or len({p.partition_index for p in parts}) != 1
                or len(set(devices)) != len(devices) or t.graph.output in op.outputs):
            continue
        per_device = _consumer_partials(t, op, consumers, found)
        if per_device is None or set(per_device) != set(devices):
            continue
        vs = {v for _, v in per_device.values()}
        if len(vs) == 1 and (v := vs.pop()) > 1 and {k for k, _ in per_device.values()} == set(
                range(v)):
            found[op.name] = per_device
    return found


def _consumer_partials(t: Transformed, op, consumers, found) -> dict[int, tuple[int, int]] | None:
    """Device -> the one partial index all consumers of ``op``'s outputs give there, or None."""
    per_device: dict[int, tuple[int, int]] = {}
    for tensor in op.outputs:
        for consumer in consumers.get(tensor, ()):
            for slot, name in enumerate(consumer.inputs):
                if name != tensor:
                    continue
                for c in t.parts[consumer.name]:
                    if c.sub.inputs[slot] is None:
                        continue
                    kv = _grad_part(t, c, slot, found)
                    if kv[1] == 1 or per_device.setdefault(c.device, kv) != kv:
                        return None
    return per_device


def _replicas(t: Transformed, part: Part, slot: int) -> int:
    """How many replicas of ``part`` read the same region of input ``slot``."""
    region = part.sub.inputs[slot]
    return sum(1 for p in t.parts[part.op]
               if p.partition_index == part.partition_index and p.sub.inputs[slot] == region)


def _copies(t: Transformed, part: Part, slot: int,
            partial: Mapping[str, Mapping[int, tuple[int, int]]]) -> int:
    """How many devices hold a copy of ``part``'s gradient contribution to input ``slot``."""
    if part.op in partial:
        mine = partial[part.op][part.device]
        return sum(1 for kv in partial[part.op].values() if kv == mine)
    return _replicas(t, part, slot)


def _weights(t: Transformed, reads: Mapping[tuple[str, str, int, int, tuple], Part],
             dtype: torch.dtype, partial: Mapping[str, Mapping[int, tuple[int, int]]] = {}
             ) -> tuple[list[Weight], dict[tuple, float]]:
    """The reducer's weights, and the gradient scale of each parameter read.

    Devices holding a region of a parameter fall into classes whose gradient contributions are
    copies of each other (their parts of every consumer are replicas of one another). When the
    classes are equal in size, the i-th device of each class sums with the i-th of the others:
    Megatron's replicated layer norms need no reduction at all, and under dp x tp they reduce over
    the dp axis only. Otherwise every holder sums and each replica counts 1/R of its gradient.
    """
    holders: dict[tuple[str, Region], dict[int, list]] = {}
    readers: dict[tuple[str, Region], list] = {}  # the reads of each holder's region, in order
    for key, p in reads.items():
        name, op, slot, device, _ = key
        if name not in t.graph.params:
            continue
        region = _region(t, name, p.sub.inputs[slot])
        # a partial-gradient replica contributes its partial k: devices with the same k hold copies
        who = ("partial", partial[op][device]) if op in partial else p.partition_index
        holders.setdefault((name, region), {}).setdefault(device, []).append((op, slot, who))
        readers.setdefault((name, region), []).append((key, p, who))
    weights: list[Weight] = []
    scales: dict[tuple, float] = {}
    unit = _units(t)
    uneven = _unequal_overlaps(holders)
    for (name, region), by_device in holders.items():
        if name in uneven:
            if uneven[name]:  # the name's first region: all its pieces, here in the order
                got, got_scales = _piece_weights(t, name, dtype, partial, unit(name))
                weights.extend(got)
                scales.update(got_scales)
                uneven[name] = []
            continue
        classes: dict[tuple, list[int]] = {}
        for device, sig in sorted(by_device.items()):
            classes.setdefault(tuple(sorted(set(sig))), []).append(device)
        sizes = {len(c) for c in classes.values()}
        shape = t.shape(name)
        if len(sizes) == 1:
            for i in range(sizes.pop()):
                group = tuple((c[i], region) for c in classes.values())
                weights.append(Weight(name, shape, dtype, group, unit(name)))
            # Replicas of one part on one device (co-shard) compute copies of one gradient,
            # and the device's leaf adds them: each counts 1/m of it.
            for key, p, who in readers[(name, region)]:
                m = by_device[key[3]].count((key[1], key[2], who))
                if m > 1:
                    scales[key] = 1.0 / m
            continue
        weights.append(Weight(name, shape, dtype, tuple((d, region) for d in sorted(by_device)),
                              unit(name)))
        for key, p, _ in readers[(name, region)]:
            scales[key] = 1.0 / _copies(t, p, key[2], partial)
    return weights, scales


def _unequal_overlaps(holders: Mapping[tuple[str, Region], Any]
                      ) -> dict[str, list[Region]]:
    """The parameters whose held regions overlap without being equal (a partition nested in
    one part of another split), each with its regions in order."""
    regions: dict[str, list[Region]] = {}
    for name, region in holders:
        regions.setdefault(name, []).append(region)
    out = {}
    for name, regs in regions.items():
        if any(a.intervals != b.intervals and a.overlaps(b)
               for i, a in enumerate(regs) for b in regs[i + 1:]):
            out[name] = regs
    return out


def _replica_fanout(t: Transformed, part: Part) -> int:
    """How many copies of ``part``'s computation its ``replicate`` ancestors make: the product,
    over the replica entries of its index, of how many siblings that level has."""
    n = 1
    for j, is_replica in enumerate(part.replica):
        if is_replica:
            prefix = part.index[:j]
            n *= len({q.index[j] for q in t.parts[part.op]
                      if len(q.index) > j and q.index[:j] == prefix})
    return n


def _piece_weights(t: Transformed, name: str, dtype: torch.dtype,
                   partial: Mapping[str, Mapping[int, tuple[int, int]]], unit: str
                   ) -> tuple[list[Weight], dict[tuple, float]]:
    """The reducer's weights of a parameter whose copies hold overlapping, unequal regions:
    one per piece on which the set of holders is constant (``holder_pieces``), summed over
    exactly those holders; and the gradient scale of each of its reads.

    Going down a part's partition tree, a split along a label the weight does not have
    (``batch``) gives each child a partial sum of the gradient of every region it holds, a
    split along one of its dims gives each child its own region, and a ``replicate`` gives each
    child a copy. So the holders of a piece together cover each copy once per ``replicate``
    fan-out on their path: each read counts ``1 / fan-out``, and the piece's gradient is the
    sum over its holders. Refused where a device would hold two overlapping, different regions
    of the weight (two leaves: no collective sums within a device) or a replica passes on a partial
    gradient (``partial_gradient_replicas``)."""
    held: dict[int, list[Region]] = {}
    scales: dict[tuple, float] = {}
    for op in t.graph.ops:
        for slot, inp in enumerate(op.inputs):
            if inp != name:
                continue
            for p in t.parts[op.name]:
                if p.sub.inputs[slot] is None:
                    continue
                region = _region(t, name, p.sub.inputs[slot])
                if op.name in partial:
                    raise UnsupportedPlacement(
                        f"the copies of weight '{name}' hold overlapping but unequal regions, "
                        f"and operator '{op.name}' passes partial gradients to them: this "
                        "runtime does not sum such gradients piece by piece",
                        p.span or p.assigned_at,
                        hint="partition every part of the operator alike, so that the copies "
                             "hold equal regions")
                mine = held.setdefault(p.device, [])
                clash = next((r for r in mine if r != region and r.overlaps(region)), None)
                if clash is not None:
                    raise UnsupportedPlacement(
                        f"device {p.device} holds two overlapping but different regions of "
                        f"weight '{name}' ({clash!r} and {region!r}): their gradients would "
                        "need a sum within one device, which this runtime does not do",
                        p.assigned_at or p.span,
                        hint="assign the parts that read overlapping regions of this weight "
                             "to different devices")
                if region not in mine:
                    mine.append(region)
                scales[(name, op.name, slot, p.device, p.index)] = 1.0 / _replica_fanout(t, p)
    shape = t.shape(name)
    # a holder is a leaf: (device, which of its regions), so that no piece spans two leaves
    pieces = holder_pieces([((d, k), r) for d, regs in sorted(held.items())
                            for k, r in enumerate(regs)])
    weights = [Weight(name, shape, dtype, tuple((d, piece) for d, _ in leaves), unit,
                      sliced=True)
               for piece, leaves in pieces]
    return weights, scales


def _units(t: Transformed) -> Callable[[str], str]:
    """A weight's module unit, with the pipeline stage of its reader (a parameter has one
    reader, ``ssdsl.trace.shared``): so no stage-3 bucket mixes two stages, even where one rank
    holds several (interleaved schedules), and each is gathered by its own stage's units. The
    readers' stages are found in one pass over the graph (a weight per region asks again)."""
    stages: dict[str, set[int]] = {}
    for op in t.graph.ops:
        for name in op.inputs:
            stages.setdefault(name, set()).add(t.stage(op.name))
    found: dict[str, str] = {}

    def unit(name: str) -> str:
        if name not in found:
            found[name] = (f"{','.join(map(str, sorted(stages.get(name, ()))))}:"
                           f"{module_unit(t.graph.params.get(name, name))}")
        return found[name]

    return unit


def _check_zero3(t: Transformed, reducer: GradReducer, schedule: Any) -> None:
    """Stage 3 gathers a bucket where a unit of work uses it: refused with a split backward,
    where the weight half runs apart from the input half."""
    for b in reducer.buckets:
        if b.zero == 3 and schedule is not None and any(
                ch in str(u) for prog in schedule.schedule.programs for u in prog.units
                for ch in "IW"):
            raise UnsupportedDirective(
                "zero stage 3 with a split backward (I and W units): the weights would have to "
                "stay gathered from the input half to the weight half", b.span,
                hint="use stage 2 with zero-bubble schedules, or a 1F1B schedule with stage 3")


def _keep_over(t: Transformed, reducer: GradReducer, schedule: Any) -> GradReducer:
    """Stage 3: the buckets of what a stage's last weight-reading operator reads (directly or
    through a tied weight's alias, ``ssdsl.trace.shared``: GPT's LM head) stay gathered from the end of a
    forward into its own backward when that comes next (every micro-batch of a plan without
    stages, the last stage of 1F1B), as FSDP2 keeps its root module: that backward needs them
    first, so it saves a gather and no memory. ``gathers`` counts what remains."""
    if not any(b.zero == 3 for b in reducer.buckets):
        return reducer
    g = t.graph
    reader = {n: op.name for op in g.ops for n in op.inputs if n in g.params}
    # values made of weights only (the alias of a tied weight, its fan-out copies): the weights
    # they are; an operator that reads nothing else is not a layer
    made_of: dict[str, frozenset[str]] = {n: frozenset({n}) for n in g.params}
    last: dict[int, frozenset[str]] = {}
    for op in g.ops:
        read = frozenset().union(*(made_of[n] for n in op.inputs if n in made_of))
        if op.inputs and all(n in made_of for n in op.inputs):
            made_of.update((out, read) for out in op.outputs)
        elif read:
            last[t.stage(op.name)] = read
    buckets = []
    for b in reducer.buckets:
        if b.zero == 3:
            stage = t.stage(reader[b.entries[0][0]])
            adjacent = _backward_next(t, schedule, stage)
            keep = adjacent > 0 and bool({n for n, _ in b.entries} & last.get(stage, set()))
            b = attrs.evolve(b, keep=keep, gathers=b.gathers - (adjacent if keep else 0))
        buckets.append(b)
    return GradReducer(tuple(buckets))


def _backward_next(t: Transformed, schedule: Any, stage: int) -> int:
    """How many forward units of ``stage`` are followed right away by their own backward."""
    if schedule is None:
        return t.microbatches  # F0 B0 F1 B1 ...
    for prog in schedule.schedule.programs:
        units = [str(u) for u in prog.units]
        if any(u.startswith(f"{stage}F") for u in units):
            return sum(1 for a, b in zip(units, units[1:])
                       if a.startswith(f"{stage}F") and b == a.replace("F", "B", 1))
    return 0


def _check_one_part_per_device(t: Transformed, schedule: Any = None) -> None:
    """Several parts of one operator on a device (co-shard) run one after another; the
    lowering does that for a plan without pipeline stages or micro-batches only."""
    if schedule is None and t.microbatches == 1:
        return
    for op, parts in t.parts.items():
        devices = [p.device for p in parts]
        if len(devices) != len(set(devices)):
            first = next(p for p in parts if devices.count(p.device) > 1)
            raise UnsupportedPlacement(
                f"operator '{op}' has several parts on device {first.device}; with stages or "
                "micro-batches the runtime runs one part of an operator per device",
                first.assigned_at,
                hint="spread the parts over as many devices as there are parts, or co-shard "
                     "(several parts per device) in a plan without stages and microbatch")
