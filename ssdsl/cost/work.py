"""From a materialized plan to the cost of each unit on each device, in seconds and bytes.

For every device and every pipeline stage this gives the time of the stage's forward and
backward on one micro-batch (its parts' compute, ``ssdsl.cost.ops``, at the device's rates, plus
the collectives of the adapters inside the stage), the activation bytes one micro-batch keeps
there, and, per pair of stages, the time a micro-batch's tensors (and gradients) take to cross.
The weight-gradient reducer and the optimizer step are costed per device. Where a unit's pieces
run is the runtime's rule (``docs/pipelines.md``): an adapter between two operators of one stage
runs inside that stage's units; one between stages delays the consumer's forward (and, for the
gradient, the producer's backward).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import attrs

from ssdsl.cost.collectives import (Link, all_gather_time, all_reduce_time, collective_time,
                                    link_for, p2p_time, reduce_scatter_time)
from ssdsl.cost.ops import (VIEW_KINDS, Work, aten_name, item_bytes, kept_slots, mask_bytes,
                            region_numel, work_of)
from ssdsl.cost.profiles import Cluster, DeviceProfile
from ssdsl.ir.grad import loss_grad_tensors
from ssdsl.ir.region import Region
from ssdsl.lower.build import classes_of, context_of
from ssdsl.lower.build import loss_collective
from ssdsl.materialize.program import Materialized
from ssdsl.materialize.steps import Adapter, CollectiveStep, PointToPoint
from ssdsl.ops import Annotation
from ssdsl.lower.overlap import overlap_plan, overlapped_buckets

ITEMSIZE = {"float64": 8, "float32": 4, "tfloat32": 4, "float16": 2, "bfloat16": 2}
# Optimizer state per parameter element, in fp32 values: SGD without momentum keeps none.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


@attrs.frozen
class UnitCost:
    """One stage's forward and backward on one micro-batch, on one device."""

    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    fwd_comm: float = 0.0
    bwd_comm: float = 0.0
    recompute: float = 0.0       # forward time re-run inside the backward
    activations: float = 0.0     # bytes kept from the forward to the backward
    recompute_peak: float = 0.0  # bytes a backward re-creates while it runs
    flops: float = 0.0           # forward + backward (+ recompute) FLOPs

    @property
    def forward(self) -> float:
        return self.fwd_compute + self.fwd_comm

    @property
    def backward(self) -> float:
        return self.bwd_compute + self.bwd_comm + self.recompute


@attrs.frozen
class StaticMemory:
    """Bytes a device holds for the whole step: parameters, their gradients, optimizer state."""

    params: float
    grads: float
    optimizer: float
    gathered: float = 0.0  # ZeRO-3: whole buckets gathered at once, for a while (an estimate)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@attrs.frozen
class PlanCosts:
    """Everything the time simulation needs (see the module doc)."""

    units: Mapping[tuple[int, int], UnitCost]          # (device, stage) -> cost
    fwd_delay: Mapping[tuple[int, int, int], float]    # (src stage, dst stage, dst device)
    bwd_delay: Mapping[tuple[int, int, int], float]    # (src stage, dst stage, src device)
    reducer: Mapping[int, float]                       # device -> gradient all-reduce time
    optimizer: Mapping[int, float]                     # device -> optimizer step time
    memory: Mapping[int, StaticMemory]
    devices: tuple[int, ...]
    # whether the step ends with a collective of its own for the loss (as the lowering decides:
    # not when every rank holds the whole loss, nor when it rides in a gradient bucket)
    loss_collective: bool = True
    # device -> the bucket parts it all-reduces during its last backward, in the order they
    # start, each (share of that backward done when its gradients are final, seconds);
    # ``reducer`` holds the other buckets, reduced after it
    overlapped: Mapping[int, tuple[tuple[float, float], ...]] = attrs.field(factory=dict)
    # (device, stage, micro-batch) of each backward unit whose program walks it in two, sending
    # its gradients after the first walk (``Backward.part``, read from the lowered programs)
    sent_first: frozenset[tuple[int, int, int]] = frozenset()
    # the same, of each backward unit whose program splits it into its input and weight halves
    # (``BackwardInput`` then ``BackwardWeight`` in a ``B`` unit): one walk's work in all
    split_first: frozenset[tuple[int, int, int]] = frozenset()
    # of those, the ones whose backward work is not one whole backward's: how many backwards'
    # work each does (an input half alone, 0.5, where its weight half runs later; the unit that
    # runs it, 0.5 more: ``ssdsl.lower.build.DEFER_W``)
    backward_work: Mapping[tuple[int, int, int], float] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class CostOptions:
    """How to cost a plan: the device, the cluster, the dtype and the optimizer."""

    profile: DeviceProfile
    cluster: Cluster
    dtype: str = "float32"
    optimizer: str = "adamw"
    momentum: bool = False

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


def plan_costs(m: Materialized, opts: CostOptions) -> PlanCosts:
    """The per-device, per-stage costs of ``m`` under ``opts``."""
    t = m.transformed
    devices = tuple(t.devices())
    units: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    _compute(m, opts, units)
    fwd_delay, bwd_delay = _adapters(m, opts, units)
    memory, reducer, optimizer, overlapped = _static(m, opts, devices)
    frozen = {k: UnitCost(**v) for k, v in units.items()}
    twice, split, work = _sent_first(m)
    return PlanCosts(frozen, fwd_delay, bwd_delay, reducer, optimizer, memory, devices,
                     loss_collective(m), overlapped, sent_first=twice, split_first=split,
                     backward_work=work)


def _sent_first(m: Materialized) -> tuple[frozenset[tuple[int, int, int]],
                                          frozenset[tuple[int, int, int]],
                                          dict[tuple[int, int, int], float]]:
    """The backward units the lowering walks in two (``Backward.part == 'sent'``), those it
    splits in halves (a ``BackwardInput`` in a ``B`` unit), and the backwards' work of those
    split units that do not do one whole backward's (``PlanCosts.backward_work``), per device:
    read from one program per pipeline rank (a rank's devices run the same units)."""
    lowered = m.schedule
    if lowered is None or lowered.schedule.stages.num_stages < 2:
        return frozenset(), frozenset(), {}
    classes, twice, split = classes_of(m), set(), set()
    work: dict[tuple[int, int, int], float] = {}
    for group in lowered.groups:
        unit, last, halves = None, None, {}
        for ins in classes.representative(group[0]).instructions:
            if ins.kind == "begin":
                unit = ins.unit
            elif unit is not None and "B" in unit and (
                    ins.kind == "backward_input" or ins.kind == "backward" and ins.part == "sent"):
                stage, mb = unit.split("B")
                into = split if ins.kind == "backward_input" else twice
                into.update((d, int(stage), int(mb)) for d in group)
            elif unit is not None and "B" in unit and ins.kind == "free" \
                    and last == "backward_weight":  # a weight half ends here
                halves[unit] = halves.get(unit, 0) + 1
            if ins.kind.startswith("backward"):
                last = ins.kind
        for d in group:
            for key in [k for k in split if k[0] == d]:
                n = halves.get(f"{key[1]}B{key[2]}", 0)
                if n != 1:  # its input half and n weight halves
                    work[key] = 0.5 + 0.5 * n
    return frozenset(twice), frozenset(split), work


# ------------------------------------------------------------------------------ compute


def _is_float(g, tensor: str) -> bool:
    return "float" in g.tensors[tensor].dtype or "complex" in g.tensors[tensor].dtype


def recomputed_regions(m: Materialized) -> dict[tuple[int, str, tuple[int, ...]], tuple]:
    """``(device, operator, part index) -> region`` for every part the runtime recomputes, read
    from the lowered programs (``RecomputeBegin`` .. ``RecomputeEnd`` around calls; the first
    forward of each stage on each rank: every micro-batch's forward runs the same regions). What
    the cost model recomputes is then what runs: a communication point ends a region there, and
    co-shard's parts run part by part, each part of a stretch its own region. Each rank class's
    program is read once (``ssdsl.lower.classes``): a member's regions are its
    representative's, with its own part at each call's position, as its program is stamped."""
    if not m.transformed.recompute:
        return {}
    ctx, classes = context_of(m), classes_of(m)
    shapes: dict[int, list[tuple[int, str, int]]] = {}  # representative -> its regions' calls
    regions: dict[tuple[int, str, tuple[int, ...]], tuple] = {}
    for rank in range(m.transformed.world):
        program = classes.representative(rank)
        calls = shapes.get(program.rank)
        if calls is None:
            calls = shapes[program.rank] = _region_calls(program, ctx)
        for number, op, pos in calls:
            regions[(rank, op, tuple(ctx.placed[(op, rank)][pos].index))] = (rank, number)
    return regions


def _region_calls(program, ctx) -> list[tuple[int, str, int]]:
    """(region number, operator, position of the part among the rank's parts of it) of every
    call inside a recomputed region of ``program``'s first forward of each stage."""
    stages_seen: set[str] = set()
    current = region = None
    number = 0
    out = []
    for ins in program.instructions:
        kind = ins.kind
        if kind == "begin":
            stage, _, _ = ins.unit.partition("F")
            current = ins.unit if "F" in ins.unit and stage not in stages_seen else None
            if current is not None:
                stages_seen.add(stage)
            region = None
        elif current is None:
            continue
        elif kind == "recompute":
            number += 1
            region = number
        elif kind == "end_recompute":
            region = None
        elif kind == "call" and region is not None:
            parts = ctx.placed[(ins.op, program.rank)]
            pos = next(i for i, p in enumerate(parts) if tuple(p.index) == tuple(ins.part))
            out.append((region, ins.op, pos))
    return out


def _part_time(w: Work, opts: CostOptions, *, backward: bool) -> float:
    p = opts.profile
    if w.view:  # a view moves nothing forward; some views' backward writes the input's gradient
        return p.view_overhead + (w.bwd_bytes / p.bytes_rate() if backward else 0.0)
    flops, moved = (w.bwd_flops, w.bwd_bytes) if backward else (w.flops, w.bytes)
    # a backward's products are each the size of the forward's: the rate is read at that size
    rate = p.attention_rate(opts.dtype, w.scores) if w.attention else \
        p.flops_rate(opts.dtype, w.flops) if w.matmul else p.peak_flops(opts.dtype)
    return p.op_overhead + max(flops / rate, moved / p.bytes_rate())


def part_work(g, op, ann: Annotation | None, part, opts: CostOptions, grads: set[str]) -> Work:
    """The work of one part of ``op`` as the device of ``opts`` runs it (``grads``: the tensors
    whose gradient the backward computes)."""
    w = work_of(g, op, ann, part, itemsize=opts.itemsize, flash=opts.profile.flash_attention,
                causal_skip=opts.profile.skips_causal)
    return _matmul_grad_share(w, op, grads) if w.matmul else w


def operator_times(m: Materialized, opts: CostOptions):
    """``(op, part, forward seconds, backward seconds or None)`` for every part of every
    operator, as the cost model times them (``bench/bench_cost.py ops`` sets them beside a
    profiled step)."""
    t = m.transformed
    g = t.graph
    grads = loss_grad_tensors(g)
    for op in g.ops:
        ann = t.annotations[op.name]
        ann = ann if isinstance(ann, Annotation) else None
        needs_bwd = any(x in grads for x in op.outputs)
        for part in t.parts[op.name]:
            w = part_work(g, op, ann, part, opts, grads)
            yield (op, part, _part_time(w, opts, backward=False),
                   _part_time(w, opts, backward=True) if needs_bwd else None)


def _compute(m: Materialized, opts: CostOptions, units) -> None:
    t = m.transformed
    g = t.graph
    # Backward runs through an operator only when an output's gradient reaches the loss: a
    # recycling pass before a .detach() (a forward-only stage) keeps nothing and has no backward.
    grads = loss_grad_tensors(g)
    regions = recomputed_regions(m)
    producer = {x: op for op in g.ops for x in op.outputs}
    base = _view_bases(g)
    saved: dict[tuple[int, int], dict[str, tuple[float, int]]] = defaultdict(dict)
    # What a recomputed region re-creates, per region of the lowered programs; a backward
    # re-creates one region at a time: its peak is the largest region's, not their sum.
    re_saved: dict[tuple, dict[str, tuple[float, int]]] = defaultdict(dict)
    region_ops: dict[tuple, set[str]] = defaultdict(set)
    where: dict[tuple, tuple[int, int]] = {}  # region -> (device, stage)
    for (device, name, _index), region in regions.items():
        region_ops[region].add(name)
        where[region] = (device, t.stage(name))
    # for the backward's walk: the forward position of each region's last operator
    last_op: dict[tuple, int] = {}
    for index, op in enumerate(g.ops):
        ann = t.annotations[op.name]
        ann = ann if isinstance(ann, Annotation) else None
        needs_bwd = any(x in grads for x in op.outputs)
        stage = t.stage(op.name)
        is_view = aten_name(op.target) in VIEW_KINDS
        for part in t.parts[op.name]:
            region = regions.get((part.device, op.name, tuple(part.index)))
            w = part_work(g, op, ann, part, opts, grads)
            u = units[(part.device, stage)]
            fwd = _part_time(w, opts, backward=False)
            u["fwd_compute"] += fwd
            u["flops"] += w.flops
            if needs_bwd:
                u["bwd_compute"] += _part_time(w, opts, backward=True)
                u["flops"] += w.bwd_flops
            if region is not None:
                u["recompute"] += fwd
                u["flops"] += w.flops
            if needs_bwd and not is_view:
                _keep(re_saved[region] if region is not None else saved[(part.device, stage)],
                      g, op, part, base, opts, grads, w, index)
                if region is not None:
                    last_op[region] = index
                    # the region's inputs from outside it stay alive
                    for x, r in zip(op.inputs, part.sub.inputs):
                        src = producer.get(base.get(x, x))
                        if r is not None and src is not None \
                                and src.name not in region_ops[region] and _is_float(g, x):
                            size = _region_bytes(g, x, r, opts.itemsize)
                            _hold(saved[(part.device, stage)], base.get(x, x), size, index)
    for key, kept in saved.items():
        units[key]["activations"] += sum(size for size, _ in kept.values())
    # A backward walks the operators in reverse: when it re-creates a region, what operators
    # after the region kept is already freed (their backward has run), what the region's and
    # earlier operators kept is still alive. A storage lives until the backward of the first
    # operator that keeps it. The unit's extra peak is the worst region's excess over all the
    # forward's activations.
    for region, kept in re_saved.items():
        device, stage = where[region]
        u = units[(device, stage)]
        end = last_op[region]
        alive = sum(size for size, first in saved[(device, stage)].values() if first <= end)
        extra = alive + sum(size for size, _ in kept.values()) - u["activations"]
        u["recompute_peak"] = max(u["recompute_peak"], extra)


def _matmul_grad_share(w: Work, op, grads: set[str]) -> Work:
    """A product whose one operand needs no gradient does half the backward products."""
    name = aten_name(op.target)
    slots = (1, 2) if name in ("addmm", "baddbmm") else (0, 1)
    n = sum(1 for s in slots if s < len(op.inputs) and op.inputs[s] in grads)
    return attrs.evolve(w, bwd_flops=w.bwd_flops * n / 2) if n < 2 else w


def _view_bases(g) -> dict[str, str]:
    """Each view's output -> the tensor whose storage it shares (followed through views)."""
    base: dict[str, str] = {}
    for op in g.ops:
        if aten_name(op.target) in VIEW_KINDS and op.inputs:
            src = base.get(op.inputs[0], op.inputs[0])
            for x in op.outputs:
                base[x] = src
    return base


def _region_bytes(g, tensor: str, region, itemsize: int) -> float:
    n = 1
    for dim in region:
        n *= sum(b - a for a, b in dim)
    return float(n * item_bytes(g, tensor, itemsize))


def _hold(into: dict[str, tuple[float, int]], key: str, size: float, index: int) -> None:
    """Keep ``size`` bytes of storage ``key`` (the largest region of it any operator keeps),
    first kept by the operator at forward position ``index``."""
    had = into.get(key)
    into[key] = (size, index) if had is None else (max(had[0], size), min(had[1], index))


def _keep(into: dict[str, tuple[float, int]], g, op, part, base, opts: CostOptions, grads,
          w: Work, index: int) -> None:
    """The activations a part keeps for its backward: the float tensors autograd saves for it
    (``ssdsl.cost.ops.kept_slots``; parameters left out; once per storage), plus what the rule
    says it saves beyond them (an unfused attention's scores, a cross-entropy's log-probabilities,
    a dropout's mask)."""
    slots, outputs = kept_slots(op, lambda x: x in grads or x in g.params)
    kept = [(op.inputs[i], part.sub.inputs[i]) for i in slots]
    if outputs:
        kept += list(zip(op.outputs, part.sub.outputs))
    for x, r in kept:
        if r is None or x in g.params or not _is_float(g, x):
            continue
        _hold(into, base.get(x, x), _region_bytes(g, x, r, opts.itemsize), index)
    extra = w.saved + mask_bytes(op, float(sum(region_numel(r) for r in part.sub.outputs)))
    if extra:
        had = into.get(f"{op.name}#saved", (0.0, index))
        into[f"{op.name}#saved"] = (had[0] + extra, had[1])


# ------------------------------------------------------------------------------ communication


def step_times(step, dtype_size: int, opts: CostOptions) -> dict[int, float]:
    """Time each device spends in one adapter step."""
    if isinstance(step, PointToPoint):
        return _p2p_times(step, dtype_size, opts)
    if not isinstance(step, CollectiveStep) or not step.nbytes or not step.groups:
        return {}
    k = len(step.groups[0])
    total = sum(len(g) for g in step.groups)
    per_member = _per_member(step.kind, step.nbytes, total, k)
    crossing: dict[int, int] = defaultdict(int)  # node -> rings leaving it at once
    for grp in step.groups:
        nodes = opts.cluster.nodes_of(grp)
        if len(nodes) > 1:
            for node in nodes:
                crossing[node] += 1
    out: dict[int, float] = {}
    for grp in step.groups:
        share = max((crossing[n] for n in opts.cluster.nodes_of(grp)), default=1)
        link = link_for(grp, opts.profile, opts.cluster, sharing=share)
        time = collective_time(step.kind, len(grp), per_member, link)
        for d in grp:
            out[d] = time
    return out


def _per_member(kind: str, nbytes: float, total: int, k: int) -> float:
    """The buffer each member passes, from the step's bytes received in total (``steps.py``)."""
    if k <= 1:
        return 0.0
    if kind == "all_gather":
        return nbytes / (total * (k - 1))
    if kind == "all_reduce":
        return nbytes * k / (2 * total * (k - 1))
    return nbytes * k / (total * (k - 1))


def _p2p_times(step: PointToPoint, itemsize: int, opts: CostOptions) -> dict[int, float]:
    sent: dict[int, float] = defaultdict(float)
    recv: dict[int, float] = defaultdict(float)
    for msg in step.messages:
        if msg.src == msg.dst:
            continue
        link = link_for((msg.src, msg.dst), opts.profile, opts.cluster)
        time = p2p_time(msg.region.numel() * itemsize, link)
        sent[msg.src] += time
        recv[msg.dst] += time
    return {d: max(sent.get(d, 0.0), recv.get(d, 0.0)) for d in {*sent, *recv}}


def adapter_times(adapter: Adapter, opts: CostOptions) -> dict[int, float]:
    """Time each device spends in ``adapter``'s steps, one after another."""
    size = adapter.dtype.itemsize if not adapter.dtype.is_floating_point else opts.itemsize
    out: dict[int, float] = defaultdict(float)
    scale = opts.itemsize / adapter.dtype.itemsize if adapter.dtype.is_floating_point else 1.0
    for step in adapter.steps:
        if isinstance(step, CollectiveStep):
            step = attrs.evolve(step, nbytes=int(step.nbytes * scale))
        for d, time in step_times(step, size, opts).items():
            out[d] += time
    return out


def _adapters(m: Materialized, opts: CostOptions, units):
    t = m.transformed
    producer = {x: op.name for op in t.graph.ops for x in op.outputs}
    fwd_delay: dict[tuple[int, int, int], float] = defaultdict(float)
    bwd_delay: dict[tuple[int, int, int], float] = defaultdict(float)
    for (tensor, op, _slot), edge in m.edges.items():
        a, b = t.stage(producer[tensor]), t.stage(op)
        fwd = adapter_times(edge.adapter, opts)
        bwd = adapter_times(edge.adapter.backward, opts) if edge.adapter.backward else {}
        if a == b:
            for d, time in fwd.items():
                units[(d, b)]["fwd_comm"] += time
            for d, time in bwd.items():
                units[(d, a)]["bwd_comm"] += time
            continue
        for d, time in fwd.items():
            fwd_delay[(a, b, d)] += time
        for d, time in bwd.items():
            bwd_delay[(a, b, d)] += time
    return dict(fwd_delay), dict(bwd_delay)


# ------------------------------------------------------------------------------ static memory


def _static(m: Materialized, opts: CostOptions, devices: tuple[int, ...]):
    t = m.transformed
    g = t.graph
    held: dict[int, dict[tuple[str, Region], int]] = defaultdict(dict)
    for (name, _op, _slot, device, _part), use in m.sources.items():
        if name in g.params:
            held[device][(name, use.region)] = use.region.numel()
    states = OPTIMIZER_STATES[opts.optimizer] if not opts.momentum else 1
    master = 4 if opts.itemsize < 4 else 0  # half precision keeps an fp32 master copy
    p = opts.profile
    memory, optimizer, reducer = {}, {}, {}
    # ZeRO: a device steps (and keeps optimizer state for) 1/p of a sharded bucket, under
    # stage 2 keeps only that chunk's gradient, under stage 3 only that chunk's weights too
    stepped, grads, kept = _zero_shares(m, held)
    gathered = _gathered_peaks(m, devices, opts.itemsize)
    for d in devices:
        params = kept[d] * opts.itemsize
        memory[d] = StaticMemory(params, grads[d] * opts.itemsize,
                                 stepped[d] * (4 * states + master), gathered.get(d, 0.0))
        # read parameter and gradient, read and write each state, write the parameter
        moved = stepped[d] * (3 * opts.itemsize + 8 * states + 2 * master)
        optimizer[d] = len(held[d]) * p.param_overhead * (1 + states) + moved / p.bytes_rate()
        reducer[d] = 0.0
    scale = opts.itemsize / m.dtype.itemsize
    sets = {b.devices for b in m.reducer.buckets}
    links = {b.devices: link_for(b.devices, p, opts.cluster,
                                 sharing=_concurrent_sets(b.devices, sets, opts.cluster))
             for b in m.reducer.buckets}
    overlapped: dict[int, tuple[tuple[float, float], ...]] = {}
    for d in devices:
        mine = m.reducer.buckets_of(d)
        nbytes = {e: e[1].numel() * b.itemsize for b in mine for e in b.entries}
        split, whole = _executor_overlap(m, d, mine, nbytes)
        overlapped[d] = _overlapped_parts(mine, split, nbytes, scale, links, at_end=not whole)
        for i, bucket in enumerate(mine):
            if i not in split:
                reducer[d] += _bucket_time(bucket, bucket.size * scale, links[bucket.devices])
    return memory, reducer, optimizer, overlapped


def _executor_overlap(m: Materialized, d: int, mine, nbytes) -> tuple[dict, bool]:
    """(the buckets of device ``d`` the executor reduces in parts during its last backward,
    by position among ``mine``, with their parts; whether that last backward instruction is
    its unit's whole backward). The runtime's own rule (``ssdsl.lower.overlap``) read on the
    program of ``d``'s rank class (its shape is the class's; ``d``'s buckets are the ones at
    the same positions). Where a unit's backward is cut by communication (tensor
    parallelism), only its last piece runs with the hooks on: a part whose weights got their
    gradients before it starts when the backward ends."""
    if not overlapped_buckets(mine, nbytes):  # what no program of these buckets could split
        return {}, True
    program = classes_of(m).representative(d)
    reduces = [ins for ins in program.instructions if ins.kind == "reduce"]
    item = mine[0].itemsize  # the runtime sizes parts by the run dtype's gradient bytes
    sizes = {e: e[1].numel() * item for ins in reduces for e in ins.entries}
    run = overlap_plan(program, sizes)
    if run is None:
        return {}, True
    position = {ins.bucket: i for i, ins in enumerate(reduces)}
    split = {position[b]: parts for b, parts in run.parts.items()}
    ins = program.instructions
    begin = max(i for i, x in enumerate(ins) if x.kind == "begin")
    # a two-walk backward's first walk computes no weight's gradient (``Backward.part``)
    pieces = sum(1 for x in ins[begin:] if x.kind in ("backward", "backward_weight")
                 and getattr(x, "part", "whole") != "sent")
    return split, pieces <= 1


def _overlapped_parts(buckets, split: Mapping[int, tuple[tuple[int, ...], ...]],
                      nbytes: Mapping, scale: float, links, *, at_end: bool = False
                      ) -> tuple[tuple[float, float], ...]:
    """Each overlapped part's (share of the last backward done when its gradients are final,
    all-reduce seconds), in the order the executor starts them (``ssdsl.runtime.overlap``).
    The backward reaches the weights in the reverse of the order the forward reads them (the
    buckets' order, and their entries'); the share is estimated by gradient bytes: a weight's
    gradient is final once the backward has got through it and every weight read after it."""
    order = [e for b in buckets for e in b.entries]
    total = float(sum(nbytes[e] for e in order)) or 1.0
    after: dict = {}
    acc = 0.0
    for e in reversed(order):
        acc += nbytes[e]
        after[e] = acc
    out = []
    for i, parts in split.items():
        b = buckets[i]
        for pos in parts:
            entries = [b.entries[j] for j in pos]
            ready = 1.0 if at_end else max(after[e] for e in entries) / total
            size = sum(nbytes[e] for e in entries) * scale
            out.append((ready, all_reduce_time(len(b.devices), size, links[b.devices])))
    return tuple(out)


def _zero_shares(m: Materialized, held: Mapping[int, Mapping[tuple[str, Region], int]]
                 ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per device, the elements its optimizer steps, the gradient elements it keeps and the
    weight elements it keeps between steps."""
    stepped = defaultdict(float, {d: float(sum(h.values())) for d, h in held.items()})
    grads = defaultdict(float, stepped)
    kept = defaultdict(float, stepped)
    for b in m.reducer.buckets:
        if not b.zero:
            continue
        numel = sum(held[d].get(e, 0) for e in b.entries for d in b.devices[:1])
        share = numel - math.ceil(numel / len(b.devices))
        for d in b.devices:
            stepped[d] -= share
            if b.zero >= 2:
                grads[d] -= share
            if b.zero == 3:
                kept[d] -= share
    return stepped, grads, kept


def _gathered_peaks(m: Materialized, devices: tuple[int, ...], itemsize: int
                    ) -> dict[int, float]:
    """ZeRO-3: per device, an estimate of the most bytes of whole (padded) buckets gathered at
    once: a bucket and the next one (prefetched while it computes), its buckets being in the
    order the forward reads them (``ssdsl.materialize.reducer``). The lowering decides exactly
    (a tied embedding read first and last stays gathered through the forward, beyond this
    estimate); this phase comes before it and reads only the buckets."""
    out: dict[int, float] = {}
    for d in devices:
        sizes = [b.padded // b.itemsize * itemsize for b in m.reducer.buckets
                 if b.zero == 3 and d in b.devices]
        pairs = [x + y for x, y in zip(sizes, sizes[1:])] or sizes
        out[d] = float(max(pairs, default=0))
    return out


def _bucket_time(bucket: Any, n: float, link: Link) -> float:
    """A bucket's collectives: an all-reduce; sharded, a reduce-scatter (stage 2) or all-reduce
    (stage 1), then the all-gather of the stepped chunks."""
    p = len(bucket.devices)
    if not bucket.zero:
        return all_reduce_time(p, n, link)
    first = reduce_scatter_time(p, n, link) if bucket.zero >= 2 else all_reduce_time(p, n, link)
    gathers = bucket.gathers if bucket.zero == 3 else 1  # stage 3: before every use
    return first + gathers * all_gather_time(p, n / p, link)


def loss_reduce_time(opts: CostOptions, devices: tuple[int, ...]) -> float:
    """The step's last collective: the loss, one float64, summed over every rank."""
    link: Link = link_for(devices, opts.profile, opts.cluster)
    return all_reduce_time(len(devices), 8.0, link)


def _concurrent_sets(devices: tuple[int, ...], sets: set[tuple[int, ...]],
                     cluster: Cluster) -> int:
    """How many reducer groups (this one included) leave a node of ``devices`` at the same time:
    disjoint device sets that cross nodes (a tp-sharded weight's dp groups reduce together)."""
    nodes = cluster.nodes_of(devices)
    if len(nodes) <= 1:
        return 1
    mine = set(devices)
    return 1 + sum(1 for s in sets if not mine & set(s) and len(cluster.nodes_of(s)) > 1
                   and cluster.nodes_of(s) & nodes)
