"""Lowering: a materialized plan and its schedule to one frozen program per rank.

For each rank, the units of its schedule program (``F(s, k)``, ``B(s, k)``; a plan without stages
runs ``F(0, k) B(0, k)`` for every micro-batch) are written out instruction by instruction:

- a forward unit walks stage s's operators in graph order. For every data edge the rank takes
  part in, at the consumer when the rank holds a part of the consumer's stage, else right after
  the producer (a send to a later stage): an adapter that moves nothing is the producer's value
  itself; one where this rank exchanges nothing is a ``LocalAdapter``; any other is a ``Comm``,
  which ends the current *segment* (its outputs are new autograd leaves). A value made in another
  segment is read through a ``Cut`` (a leaf), so every segment's autograd graph stands alone.
- a backward unit mirrors its forward: the segments' ``Backward`` in reverse order, each after
  the backward ``Comm`` of the communication point that follows it. So every rank's backward
  communication has a fixed order, written in its program.
- a split backward (a schedule of ``I`` and ``W`` units, zero-bubble pipelines): an ``I`` unit
  is the backward unit with ``BackwardInput`` (gradients of what the segment received only, all
  its backward communication), a ``W`` unit the segments' ``BackwardWeight`` and the ``Free``.
  For that, forward tells the two sides of each segment apart: a value is on the *activation
  side* when it depends on a leaf the segment received (a cut, a communicated leaf), on the
  *weight side* when it depends on parameters only. A call that reads both reads each weight-side
  input through a weight cut (a ``Cut`` of its own): so the input half's autograd reaches no
  weight (the product of a weight gradient is left out: it is not asked for), and the weight
  half starts at those cuts, from the output gradients the input half kept. A rank's last
  backward unit is split the same way inside its ``B`` unit where its stage sends gradients to
  another device (``_split_last``): input half, the sends, weight half.
- ``recompute`` selections become ``RecomputeBegin``/``RecomputeEnd`` around each run of selected
  calls inside one segment: a communication point ends a run, so recompute never communicates.
- several parts of one operator on a rank (co-shard) are several ``Call``s, in part order, and
  the rank's slots of that operator's adapters; where every edge between a stretch of such
  operators hands part j to part j, the stretch runs part by part, and a recomputed region holds
  one part only, so one part's activations are alive at a time (``_RankLowering._steps``).
- after the units: ``WaitSends``, the weight-gradient buckets this rank is in, ``LossSum`` (unless
  the step's loss rides in the last bucket of all ranks; over this rank alone, which meets no
  one, when every rank holds the whole loss: ``own_loss``), and
  ``OptimizerStep``; then a ``GatherBucket`` per ZeRO-sharded bucket (``zero``) of stage 1 or 2,
  which rebuilds the weights from the chunks each member stepped.
- ZeRO stage 3 buckets (one per module unit, ``ssdsl.materialize.reducer``) live gathered only
  around their uses. In a forward unit, the first operator that reads a bucket's weights starts
  a new segment (so that backward runs layer by layer) behind ``GatherParams`` (unless already
  prefetched) and ``WaitParams``; the gather of the next bucket in the stage's order is issued
  right after, to overlap with this layer's compute; ``FreeParams`` follows the last
  instruction of the unit that reads the weights (or a view of them), but a bucket marked
  ``keep`` (what the last layer reads) stays gathered into the unit's own backward when that
  comes next. A backward unit mirrors
  it: before a segment's ``Backward`` the buckets its autograd reaches are gathered and waited
  for, the next segment's are prefetched, and after the segment where a bucket is used last it
  is freed; in the stage's last backward unit its gradient is reduce-scattered right there
  (``ReduceBucket``, stage 3). With micro-batches every unit gathers again (gather per use).

Message tags are unique per (edge, micro-batch, direction, message), so messages in flight at
the same time never match each other's receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ssdsl.gcpause import gc_paused
from ssdsl.ir.graph import Op
from ssdsl.lower.instr import (Backward, BackwardInput, BackwardWeight, Begin, Call, Coll, Comm,
                               Cut, End, Free, FreeParams, GatherBucket, GatherParams,
                               LocalAdapter, LocalStep, LossSum, Msg, OptimizerStep, P2P, Program,
                               WaitParams,
                               RecomputeBegin, RecomputeEnd, ReduceBucket, TakeBuffer, TakeInput,
                               TakeParam, WaitSends, moves, reads, writes)
from ssdsl.materialize.program import Edge, Materialized
from ssdsl.materialize.steps import Adapter, CollectiveStep, PointToPoint
from ssdsl.source import Span
from ssdsl.transform.parts import Part

# Messages of one adapter direction get tags ``base * stride + i``; base is unique per (edge,
# micro-batch, direction). The stride is TAG_STRIDE, or the least power-of-two multiple of it that
# holds the plan's largest adapter direction (``tag_stride``: 4,096 ranks move some tensors in
# 8,192 messages), so a plan that fits keeps its tags.
TAG_STRIDE = 4096
# a rank's last backward sends the stage before its gradients before computing the weights'
# (``_RankLowering._sent_first``) where the plan's job allows it (``Materialized.send_first``);
# False lowers every backward in one walk whatever the job says (benchmarks compare)
SEND_FIRST = True

# True: that last backward is split into its input and weight halves (``_split_last``), one walk
# in all; False: walked twice, the second time whole (``_sent_first``; benchmarks compare)
SPLIT_LAST = True

# True: the rank of pipeline stage k > 0 (its first stage, where its backwards send gradients to
# another device) also splits its first k backwards into their halves and runs their weight
# halves at the end, after its last backward's (``_split_last``, ``_backward``): the chain of
# gradients down the pipeline starts a weight half sooner and stays ahead, and the deferred
# halves fill the cool-down, where this rank waits for the stages before to finish. A stage k
# holds k + (stages - k) micro-batches' activations at most, the first stage's 1F1B bound.
# Only where the ranks have cores of their own (``Materialized.send_first``: a split costs
# CPU). False splits the last backward only (benchmarks compare)
DEFER_W = True

# False sums the loss over all ranks even where each holds all of it (``own_loss``;
# ``bench/bench_peers.py --off own_loss`` compares)
OWN_LOSS = True


def tag_stride(m: Materialized) -> int:
    """The tag stride of ``m``'s programs (see ``TAG_STRIDE``)."""
    most = max((_messages(ad) for e in m.edges.values()
                for ad in (e.adapter, e.adapter.backward) if ad is not None), default=0)
    stride = TAG_STRIDE
    while stride < most:
        stride *= 2
    return stride


def _messages(adapter: Adapter) -> int:
    return sum(len(s.messages) for s in adapter.steps if isinstance(s, PointToPoint))


@attrs.frozen
class ProgramSet:
    """Every rank's program, ``programs[r].rank == r``."""

    world: int
    programs: tuple[Program, ...]

    def __getitem__(self, rank: int) -> Program:
        return self.programs[rank]


@gc_paused()
def lower_plan(m: Materialized, *, direct: bool = False) -> ProgramSet:
    """One program per rank of ``m`` (``m.transformed.world`` ranks), each rank class lowered
    once (``ssdsl.lower.classes``); ``direct``: every rank lowered by itself."""
    world = m.transformed.world
    return ProgramSet(world, tuple(lower_rank(m, r, direct=direct) for r in range(world)))


def lower_rank(m: Materialized, rank: int, *, direct: bool = False) -> Program:
    """The program of ``rank``: stamped from its class's representative
    (``ssdsl.lower.classes``), or with ``direct`` lowered by itself (the same program)."""
    if direct:
        return _RankLowering(context_of(m), rank).program()
    return classes_of(m).program(rank)


_LAST: list[tuple[Materialized, _Context]] = []
_LAST_CLASSES: list[tuple[Materialized, Any]] = []


def context_of(m: Materialized) -> _Context:
    """What every rank's lowering of ``m`` shares, made once for the plan lowered last (a
    1,024-rank plan is lowered rank by rank, by the code writer, without holding every
    program at once)."""
    if _LAST and _LAST[0][0] is m:
        return _LAST[0][1]
    ctx = _Context.of(m)
    _LAST[:] = [(m, ctx)]
    return ctx


def classes_of(m: Materialized):
    """The rank classes of ``m`` (``ssdsl.lower.classes.ClassLowering``), for the plan lowered
    last: their representatives are lowered once, whichever rank asks first."""
    from ssdsl.lower.classes import ClassLowering
    if _LAST_CLASSES and _LAST_CLASSES[0][0] is m:
        return _LAST_CLASSES[0][1]
    found = ClassLowering(context_of(m))
    _LAST_CLASSES[:] = [(m, found)]
    return found


# -- what every rank's lowering shares ------------------------------------------------------------


@attrs.frozen
class _Context:
    m: Materialized
    ops_of: dict[int, list[Op]]
    stage_devices: dict[int, frozenset[int]]
    producer: dict[str, Op]
    after: dict[str, list[tuple[str, str, int]]]       # producer op -> edges it feeds
    edge_ids: dict[tuple[str, str, int], int]
    units: tuple[tuple[tuple[int, ...], tuple[tuple[str, Span | None], ...]], ...]
    recompute: dict[str, Span]
    # (op, device) -> the op's parts there, row-major: several under co-shard
    placed: dict[tuple[str, int], tuple[Part, ...]]
    edge_keys: tuple[tuple[str, str, int], ...]  # by edge id
    stride: int  # of message tags (``tag_stride``)
    # when every rank holds the whole loss (``own_loss``): per rank, the loss parts it counts
    own_loss: dict[int, frozenset[tuple[int, ...]]] | None

    @classmethod
    def of(cls, m: Materialized) -> _Context:
        t, g = m.transformed, m.transformed.graph
        ops_of: dict[int, list[Op]] = {}
        devices: dict[int, set[int]] = {}
        for op in g.ops:
            s = t.stage(op.name)
            ops_of.setdefault(s, []).append(op)
            devices.setdefault(s, set()).update(p.device for p in t.parts[op.name])
        producer = g.producer()
        after: dict[str, list[tuple[str, str, int]]] = {}
        for key in m.edges:
            after.setdefault(producer[key[0]].name, []).append(key)
        # resolved (stages included) and checked at the statements by the schedule phase
        recompute: dict[str, Span] = dict(t.recompute)
        placed: dict[tuple[str, int], tuple[Part, ...]] = {}
        for op, parts in t.parts.items():
            for p in parts:
                placed[(op, p.device)] = placed.get((op, p.device), ()) + (p,)
        return cls(m, ops_of, {s: frozenset(d) for s, d in devices.items()}, producer, after,
                   {key: i for i, key in enumerate(m.edges)}, _unit_programs(m), recompute,
                   placed, tuple(m.edges), tag_stride(m), own_loss(m))

    def first(self, op: str, rank: int) -> Part | None:
        """The first part of ``op`` on ``rank`` (for plan lines), or None."""
        parts = self.placed.get((op, rank))
        return parts[0] if parts else None


def own_loss(m: Materialized) -> dict[int, frozenset[tuple[int, ...]]] | None:
    """Per rank, the loss parts it counts when every rank holds the whole loss, else None.

    The loss operator's parts fall into classes of replicas (one class per partition index:
    a value split of the loss, by batch under data parallelism, gives several). When every rank
    holds a part of every class and runs every micro-batch of the loss (a plan without stages,
    or a loss stage on every rank), each rank has the step's whole loss in its own parts, one
    per class (its first): replicated losses, as under tensor parallelism, need no collective
    to be reported. Otherwise the loss parts are summed over all ranks, each counted once."""
    t = m.transformed
    if not OWN_LOSS:
        return None
    loss_op = t.graph.producer()[t.graph.output].name
    parts = t.parts[loss_op]
    classes = {p.partition_index for p in parts}
    everyone = set(range(t.world))
    if m.schedule is not None and {p.device for p in parts} != everyone:
        return None
    counted: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for p in parts:  # row-major: the first part of a class on a rank is the one it counts
        counted.setdefault(p.device, {}).setdefault(p.partition_index, p.index)
    if set(counted) != everyone or any(set(c) != classes for c in counted.values()):
        return None
    return {r: frozenset(c.values()) for r, c in counted.items()}


def loss_bucket(m: Materialized) -> int | None:
    """The gradient bucket the step's loss rides in: the last that every rank all-reduces (a
    reduce-scatter gives each rank only its chunk: the loss cannot ride in it); None when there
    is none (then a ``LossSum`` of its own reports it, unless ``own_loss``)."""
    everyone = tuple(range(m.transformed.world))
    return max((i for i, b in enumerate(m.reducer.buckets)
                if tuple(b.devices) == everyone and b.zero < 2), default=None)


def loss_collective(m: Materialized) -> bool:
    """Whether the step ends with a collective of its own for the loss (``LossSum`` over more
    than one rank): not when every rank holds the whole loss, nor when it rides in a bucket."""
    return m.transformed.world > 1 and own_loss(m) is None and loss_bucket(m) is None


def unit_order(m: Materialized, rank: int) -> tuple[tuple[str, Span | None], ...]:
    """The units ``rank`` runs, in the schedule's order, each with its plan line."""
    return next((us for group, us in _unit_programs(m) if rank in group), ())


def _unit_programs(m: Materialized):
    if m.schedule is not None:
        return tuple((group, tuple((str(u), s) for u, s in zip(prog.units, prog.spans)))
                     for group, prog in zip(m.schedule.groups, m.schedule.schedule.programs))
    everyone = tuple(range(m.transformed.world))
    units = tuple((f"0{p}{k}", None) for k in range(m.transformed.microbatches) for p in "FB")
    return ((everyone, units),)


# -- localizing adapter steps ---------------------------------------------------------------------


def localize(adapter: Adapter, rank: int, tag_base: int, stride: int = TAG_STRIDE
             ) -> tuple[LocalStep, ...]:
    """What ``rank`` does in each step of ``adapter``; message ``i`` of the adapter's
    point-to-point steps gets tag ``tag_base * stride + i``."""
    return stamp(rank_view(adapter, rank), tag_base, stride)


# A rank's share of an adapter's steps, tags left open: a ``Coll``, or a point-to-point step as
# (messages up to its end, this rank's sources, its targets, its messages as (index, kind, peer,
# src slot, dst slot, region)). Made once per rank and adapter, stamped once per micro-batch and
# direction: a 4,096-rank adapter's steps list every rank's messages.
RankView = tuple[Any, ...]


def rank_view(adapter: Adapter, rank: int) -> RankView:
    """``rank``'s share of ``adapter``'s steps (see ``RankView``)."""
    out: list[Any] = []
    n = 0
    for step in adapter.steps:
        if isinstance(step, PointToPoint):
            out.append(_p2p_view(step, rank, n))
            n += len(step.messages)
        else:
            group = next((g for g in step.groups if rank in g), None)
            if group is not None:
                out.append(_local_coll(step, group))
    return tuple(out)


def stamp(view: RankView, tag_base: int, stride: int = TAG_STRIDE) -> tuple[LocalStep, ...]:
    """The local steps of ``view`` with the tags of ``tag_base`` (``localize``)."""
    out: list[LocalStep] = []
    first = tag_base * stride
    for step in view:
        if isinstance(step, Coll):
            out.append(step)
            continue
        end, sources, targets, msgs = step
        if end > stride:
            raise ValueError(f"an adapter of {end} messages (at most {stride})")
        out.append(P2P(sources, targets, tuple(Msg(kind, peer, first + i, src, dst, region)
                                               for i, kind, peer, src, dst, region in msgs)))
    return tuple(s for s in out if not (isinstance(s, P2P) and not s.msgs and not s.targets))


def _local_coll(step: CollectiveStep, group: tuple[int, ...]) -> Coll:
    return Coll(step.kind, tuple(group), getattr(step, "dim", 0), getattr(step, "cat_dim", 0),
                getattr(step, "split_dim", 0))


def _p2p_view(step: PointToPoint, rank: int, first: int) -> tuple[Any, ...]:
    msgs = []
    for i, msg in enumerate(step.messages, first):
        if msg.src == rank and msg.dst == rank:
            msgs.append((i, "copy", rank, msg.src_slot, msg.dst_slot, msg.region))
        elif msg.src == rank:
            msgs.append((i, "send", msg.dst, msg.src_slot, msg.dst_slot, msg.region))
        elif msg.dst == rank:
            msgs.append((i, "recv", msg.src, msg.src_slot, msg.dst_slot, msg.region))
    return (first + len(step.messages), tuple(r for d, r in step.sources if d == rank),
            tuple(r for d, r in step.targets if d == rank), tuple(msgs))


def _passthrough(adapter: Adapter, rank: int) -> bool:
    """Whether ``adapter`` hands this rank its own tensors, slot for slot (no step in either
    direction): consumer slot j on this rank reads producer slot j's value."""
    if adapter.steps or (adapter.backward is not None and adapter.backward.steps):
        return False
    mine = [r for d, r in adapter.producers if d == rank]
    return len(mine) >= 1 and mine == [r for d, r in adapter.consumers if d == rank]


def _has_grad(adapter: Adapter) -> bool:
    return adapter.backward is not None and adapter.dtype.is_floating_point


# -- one rank -----------------------------------------------------------------------------------


@attrs.define
class _Point:
    """A communication point of a forward unit, for its backward mirror."""

    comm: Comm
    key: tuple[str, str, int]


@attrs.define
class _Segment:
    index: int
    seeds: list[str] = attrs.Factory(list)
    roots: list[str] = attrs.Factory(list)
    collect: list[tuple[str, str]] = attrs.Factory(list)
    span: Span | None = None
    inputs: list[str] = attrs.Factory(list)  # received leaves it reads (split backward)
    buckets: set[int] = attrs.Factory(set)  # ZeRO-3 buckets whose weights its calls read
    mixes: list[tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = attrs.Factory(list)
    mix_inputs: list[str] = attrs.Factory(list)  # the mixing calls' inputs other than cuts
    recomputed: bool = False  # some of its calls run again in backward (checkpointed)


class _RankLowering:
    def __init__(self, ctx: _Context, rank: int) -> None:
        self.c, self.rank = ctx, rank
        self.m = ctx.m
        self.t = ctx.m.transformed
        self.graph = self.t.graph
        self.out: list[Any] = []
        self.seg: _Segment | None = None
        self.n_segments = 0
        self.defined_in: dict[str, _Segment] = {}
        self.leaves: set[str] = set()
        self.uncollected: set[str] = set()
        self.cuts: dict[tuple[str, int], str] = {}
        self.takes: dict[tuple, str] = {}
        self.take_ids: dict[tuple, int] = {}
        self.forward_items: dict[str, list] = {}     # unit -> [segment | point] in order
        self.made: dict[str, list[str]] = {}         # unit -> values it defines
        self.region_start: int | None = None
        self.region_span: Span | None = None
        # a split backward's two sides (see the module docstring): values depending on a received
        # leaf (the leaves included), values depending on a parameter
        self.split = False
        self.split_units: frozenset[str] = frozenset()  # forward units split alone (_split_last)
        self.deferred_w: frozenset[str] = frozenset()  # DEFER_W: forwards whose W waits
        self.pending_w: list[tuple[int, int, Span | None]] = []  # DEFER_W: halves waiting
        self._sends_back_stage: dict[int, bool] = {}
        self._units: tuple = ()
        self.activation_side: set[str] = set()
        self.weight_dep: set[str] = set()
        self.n_weight_cuts = 0
        self.region_chunk: int | None = None
        self.n_regions = 0
        # ZeRO stage 3: this rank's (weight, region) -> bucket; values that are the bucket's
        # weights or made from them (and buffers) only; per forward unit, what is gathered
        buckets = self.m.reducer.buckets
        self.z3 = {e: i for i, b in enumerate(buckets) if b.zero == 3 and rank in b.devices
                   for e in b.entries}
        self.holds: dict[str, frozenset[int]] = {}
        self.neutral: set[str] = set()
        self.last_use: dict[int, Any] = {}
        self.started: set[int] = set()
        self.gathered: set[int] = set()
        self.z3_order: dict[int, list[int]] = {}
        self.last_backward: dict[int, str] = {}
        self.device_last_backward: str | None = None  # this rank's last B unit
        self.reduced: set[int] = set()
        self.next_unit: dict[str, str] = {}
        self.kept: tuple[str, frozenset[int]] = ("", frozenset())  # forward unit, buckets
        # what every micro-batch of a unit asks again of the plan for this rank, asked once
        self._passes: dict[int, bool] = {}  # id(adapter) -> _passthrough (adapters outlive it)
        self._reader_lists: dict[tuple[str, int], list[Part]] = {}
        self._spans: dict[tuple, Span | None] = {}
        self._views: dict[int, tuple[Any, RankView]] = {}  # id(adapter) -> (it, its view)
        self._role_of: dict[int, tuple[bool, bool, int, tuple, tuple]] = {}
        self._here: dict[tuple[str, str, int], tuple[Edge | None, bool]] = {}
        self._sends_of: dict[str, list[tuple[Edge, tuple[str, str, int]]]] = {}
        # id(instruction) -> where its rank-dependent fields came from, for stamping this
        # program onto the other ranks of its class (``ssdsl.lower.classes``)
        self.sites: dict[int, tuple] = {}

    # -- driver ------------------------------------------------------------------------------
    def program(self) -> Program:
        units = next((us for group, us in self.c.units if self.rank in group), ())
        self.split = any(_split_unit(u)[1] in "IW" for u, _ in units)
        frozen = self.m.schedule.schedule.stages.forward_only if self.m.schedule else frozenset()
        for unit, _ in units:
            if _split_unit(unit)[1] == "B":
                self.last_backward[_split_unit(unit)[0]] = unit
                self.device_last_backward = unit
        self._units = units
        self.split_units = self._split_last()
        self.next_unit = {a: b for (a, _), (b, _) in zip(units, units[1:])}
        for unit, span in units:
            self.out.append(Begin(unit, span=span, grad=_split_unit(unit)[0] not in frozen))
            stage, pass_, mb = _split_unit(unit)
            if pass_ == "F":
                self._forward(unit, stage, mb)
            elif pass_ == "B":
                self._backward(unit, stage, mb, span)
                if unit == self.device_last_backward:  # DEFER_W: they wait no longer
                    for pending in self.pending_w:
                        self._weight_grad(*pending)
                    self.pending_w = []
            elif pass_ == "I":
                self._input_grad(stage, mb, span)
            elif pass_ == "W":
                self._weight_grad(stage, mb, span)
            self.out.append(End(unit, span=span))
        self.out = _free_forward_only(self.out, self.made)
        tail = self._anchor()
        self.out.append(WaitSends(span=tail))
        everyone = tuple(range(self.t.world))
        buckets = self.m.reducer.buckets
        local = self.c.own_loss is not None
        carrier = None if local else loss_bucket(self.m)
        for i, b in enumerate(buckets):
            if self.rank in b.devices and i not in self.reduced:
                self.out.append(ReduceBucket(i, tuple(b.devices), tuple(b.entries),
                                             span=b.span or self._weight_span(b.entries),
                                             loss=i == carrier, zero=b.zero))
        if carrier is None:
            self.out.append(LossSum((self.rank,) if local else everyone, span=tail))
        self.out.append(OptimizerStep(span=tail))
        for i, b in enumerate(buckets):
            if self.rank in b.devices and b.zero in (1, 2):
                self.out.append(GatherBucket(i, tuple(b.devices), tuple(b.entries), span=b.span))
        return Program(self.rank, self.t.world, tuple(_fill_recompute(self.out)))

    def _anchor(self) -> Span | None:
        """A plan line for the step's tail: the first assign that placed a part here."""
        for op in self.graph.ops:
            p = self.c.first(op.name, self.rank)
            if p is not None and (p.assigned_at or p.span) is not None:
                return p.assigned_at or p.span
        for p in (p for ps in self.t.parts.values() for p in ps):
            if p.assigned_at is not None:
                return p.assigned_at
        return None

    def _weight_span(self, entries) -> Span | None:
        names = {name for name, _ in entries}
        for op in self.graph.ops:
            if names & set(op.inputs):
                p = self.c.first(op.name, self.rank)
                if p is not None and (p.assigned_at or p.span) is not None:
                    return p.assigned_at or p.span
        return self._anchor()

    # -- segments --------------------------------------------------------------------------------
    def _new_segment(self, unit: str, span: Span | None) -> None:
        self._close_region()
        self.seg = _Segment(self.n_segments, span=span)
        self.n_segments += 1
        self.forward_items[unit].append(self.seg)

    def _define(self, value: str, unit: str) -> None:
        self.defined_in[value] = self.seg
        self.made[unit].append(value)

    def _use(self, value: str, unit: str) -> str:
        """``value`` as the current segment may read it (a leaf, or a cut of another segment's)."""
        if value in self.uncollected:
            # a communicated leaf: its gradient is taken after the backward of the segment
            # that reads it (which may follow other communication points)
            self.uncollected.discard(value)
            self.seg.collect.append((value, value))
        if value in self.leaves or self.defined_in.get(value) is self.seg:
            # a received leaf may be read by a later segment than its own (a cut made while
            # the inputs of a call were gathered, before one of them communicated): each
            # segment that reads it adds to its gradient
            if value in self.leaves and value in self.activation_side \
                    and value not in self.seg.inputs:
                self.seg.inputs.append(value)
            return value
        key = (value, self.seg.index)
        if key not in self.cuts:
            cut = f"{value}|{self.seg.index}"
            self.cuts[key] = cut
            ins = Cut(cut, value, span=self.seg.span)
            if self.region_start is not None:  # a cut must stay outside a recomputed region
                self.out.insert(self.region_start, ins)
                self.region_start += 1
            else:
                self.out.append(ins)
            if self.z3:
                self._flow((value,), (cut,), ins)
            self.leaves.add(cut)
            self.made[unit].append(cut)
            self.seg.collect.append((cut, value))
            self.seg.inputs.append(cut)
            self.activation_side.add(cut)
            src_seg = self.defined_in.get(value)
            if src_seg is not None and value not in src_seg.roots:
                src_seg.roots.append(value)
        return self.cuts[key]

    # -- forward ------------------------------------------------------------------------------
    def _forward(self, unit: str, stage: int, mb: int) -> None:
        self.forward_items[unit] = []
        self.made[unit] = []
        self.edge_outs: dict[tuple, tuple[str, ...] | None] = {}
        self._new_segment(unit, None)
        unit_start = len(self.out)
        self.last_use, self.started, self.gathered = {}, set(), set()
        for op, part, chunk, last in self._steps(stage):
            if part is None or op.name not in self.c.recompute or chunk != self.region_chunk:
                self._close_region()  # before this op's inputs: they belong outside
            if self.z3 and part is not None:
                new = [b for b in self._z3_reads(op, part) if b not in self.started]
                if new:
                    self._open_buckets(new, unit, stage)
            self.seg.span = self.seg.span or (part.span if part is not None else None)
            local = [self._input(op, slot, name, part, unit, stage, mb)
                     for slot, name in enumerate(op.inputs)]
            if part is not None:
                self._call(op, part, local, unit, mb, chunk)
            else:
                self._close_region()
            if not last:
                continue
            for edge, key in self._sends(op.name):
                self._adapter(edge, key, unit, mb, part)
        self._close_region()
        if self.z3:
            self._free_after_last_use(unit, unit_start)

    # -- ZeRO stage 3 ------------------------------------------------------------------------------
    def _z3_reads(self, op: Op, part: Part) -> list[int]:
        """The stage-3 buckets whose weights ``part`` of ``op`` reads, in slot order."""
        out: list[int] = []
        for slot, name in enumerate(op.inputs):
            if name not in self.graph.params or part.sub.inputs[slot] is None:
                continue
            use = self.m.sources.get((name, op.name, slot, self.rank, part.index))
            b = self.z3.get((name, use.region)) if use is not None else None
            if b is not None and b not in out:
                out.append(b)
        return out

    def _bucket_order(self, stage: int) -> list[int]:
        """The stage-3 buckets in the order stage ``stage``'s forward first reads them here."""
        if stage not in self.z3_order:
            order: list[int] = []
            for op, part, _, _ in self._steps(stage):
                if part is not None:
                    order += [b for b in self._z3_reads(op, part) if b not in order]
            self.z3_order[stage] = order
        return self.z3_order[stage]

    def _gather(self, b: int, gathered: set[int]) -> None:
        bucket = self.m.reducer.buckets[b]
        self.out.append(GatherParams(b, tuple(bucket.devices), tuple(bucket.entries),
                                     span=bucket.span))
        gathered.add(b)

    def _open_buckets(self, new: list[int], unit: str, stage: int) -> None:
        """The first reader of buckets ``new`` in this forward unit: a new segment (backward
        runs layer by layer), their gathers unless prefetched, and the next bucket's prefetch."""
        self._new_segment(unit, None)
        for b in new:
            if b not in self.gathered:
                self._gather(b, self.gathered)
            self.out.append(WaitParams(b, span=self.m.reducer.buckets[b].span))
            self.started.add(b)
        order = self._bucket_order(stage)
        after = max(order.index(b) for b in new)
        nxt = next((b for b in order[after + 1:] if b not in self.started), None)
        if nxt is not None and nxt not in self.gathered:
            self._gather(nxt, self.gathered)

    def _used(self, buckets: frozenset[int], ins: Any) -> None:
        self.seg.buckets |= buckets
        for b in buckets:
            self.last_use[b] = ins

    def _flow(self, ins: Sequence[str | None], outs: Sequence[str], at: Any) -> None:
        """Instruction ``at`` reads ``ins``: a use of the buckets they hold; its outputs hold
        them too when it reads nothing else (a view or a cast of a weight is a weight)."""
        vs = [v for v in ins if v is not None]
        held = frozenset().union(*(self.holds.get(v, frozenset()) for v in vs))
        if not held:
            return
        self._used(held, at)
        if all(v in self.holds or v in self.neutral for v in vs):
            for o in outs:
                self.holds[o] = held

    def _free_after_last_use(self, unit: str, start: int) -> None:
        """A ``FreeParams`` after each bucket's last use in this forward unit (after the
        recomputed region holding it: a region's instructions run again in backward), except
        for the buckets marked ``keep`` when this unit's own backward comes next: they stay
        gathered into it (``ssdsl.materialize.program``)."""
        stage, _, mb = _split_unit(unit)
        keep = frozenset(b for b in self.gathered if self.m.reducer.buckets[b].keep) \
            if self.next_unit.get(unit) == f"{stage}B{mb}" else frozenset()
        self.kept = (unit, keep)
        inserts = []
        for b in sorted(self.gathered - keep):
            at = self.last_use.get(b)
            pos = next((i for i in range(start, len(self.out)) if self.out[i] is at),
                       len(self.out) - 1)
            inside = False
            for i in range(start, pos + 1):
                kind = self.out[i].kind
                inside = (inside or kind == "recompute") and kind != "end_recompute"
            while inside and self.out[pos].kind != "end_recompute":
                pos += 1
            inserts.append((pos + 1, b))
        for pos, b in sorted(inserts, reverse=True):
            self.out.insert(pos, FreeParams(b, span=self.m.reducer.buckets[b].span))

    def _steps(self, stage: int):
        """``(op, part, chunk, last)`` in the order this rank runs stage ``stage``'s operators:
        graph order, one step per part held here (``part`` None: none held; ``last``: the op's
        last part here, after which the edges it sends onwards are written).

        A *run* is a stretch of consecutive operators of which this rank holds the same number
        k > 1 of parts (co-shard). When every edge inside the run hands part j's output to part
        j of the next operator on this rank (no adapter steps), the run goes part-major: all of
        part 0, then all of part 1, ... (``chunk`` = j), so with ``recompute`` only one part's
        activations are alive at a time. Otherwise operator-major (``chunk`` None), which is
        the graph's order and always sound.
        """
        ops = self.c.ops_of.get(stage, [])
        i = 0
        while i < len(ops):
            parts = self.c.placed.get((ops[i].name, self.rank), ())
            if len(parts) < 2:
                yield ops[i], parts[0] if parts else None, None, True
                i += 1
                continue
            j = i
            while j < len(ops) and len(self.c.placed.get((ops[j].name, self.rank), ())) == \
                    len(parts):
                j += 1
            run = ops[i:j]
            if self._part_major(run):
                for c in range(len(parts)):
                    for op in run:
                        yield op, self.c.placed[(op.name, self.rank)][c], c, c == len(parts) - 1
            else:
                for op in run:
                    held = self.c.placed[(op.name, self.rank)]
                    for n, p in enumerate(held):
                        yield op, p, None, n == len(held) - 1
            i = j

    def _part_major(self, run: Sequence[Op]) -> bool:
        inside = {op.name for op in run}
        for op in run:
            for slot, name in enumerate(op.inputs):
                edge = self.m.edges.get((name, op.name, slot))
                if edge is None or self.c.producer[name].name not in inside:
                    continue
                if not self._passthrough(edge.adapter) or len(
                        self._readers(op.name, slot)) != len(self.c.placed[(op.name, self.rank)]):
                    return False
        return True

    def _readers(self, op: str, slot: int) -> list[Part]:
        """This rank's parts of ``op`` that read input ``slot``: its consumer slots, in order."""
        found = self._reader_lists.get((op, slot))
        if found is None:
            found = self._reader_lists[(op, slot)] = [
                p for p in self.c.placed.get((op, self.rank), ()) if p.sub.inputs[slot] is not None]
        return found

    def _view(self, adapter: Adapter) -> RankView:
        found = self._views.get(id(adapter))
        if found is None or found[0] is not adapter:
            found = self._views[id(adapter)] = (adapter, rank_view(adapter, self.rank))
        return found[1]

    def _roles(self, adapter: Adapter) -> tuple[bool, bool, int, tuple, tuple]:
        """Whether this rank produces and consumes ``adapter``'s tensor, its consumer slots, and
        the local shapes of its producer and its consumer slots (once per adapter)."""
        found = self._role_of.get(id(adapter))  # adapters outlive this rank's lowering
        if found is None:
            mine = [r for d, r in adapter.producers if d == self.rank]
            took = [r for d, r in adapter.consumers if d == self.rank]
            found = self._role_of[id(adapter)] = (
                bool(mine), bool(took), len(took), tuple(r.local_shape for r in mine),
                tuple(r.local_shape for r in took))
        return found

    def _passthrough(self, adapter: Adapter) -> bool:
        found = self._passes.get(id(adapter))
        if found is None:
            found = self._passes[id(adapter)] = _passthrough(adapter, self.rank)
        return found

    def _position(self, op: str, part: Part) -> int:
        """Where ``part`` stands among this rank's parts of ``op``."""
        return next(i for i, p in enumerate(self.c.placed[(op, self.rank)]) if p is part)

    def _value(self, tensor: str, op: str, part: Part, mb: int) -> str:
        """The name of ``part``'s output ``tensor``: ``x@mb``, or ``x~j@mb`` for the j-th of
        several parts of ``op`` on this rank."""
        held = self.c.placed.get((op, self.rank), ())
        return f"{tensor}@{mb}" if len(held) < 2 else f"{tensor}~{held.index(part)}@{mb}"

    def _edge_here(self, key: tuple[str, str, int]) -> tuple[Edge | None, bool]:
        """Edge ``key`` (None: a source's use) and whether this rank takes part in it at the
        consumer (once per rank: every micro-batch asks again)."""
        found = self._here.get(key)
        if found is None:
            edge = self.m.edges.get(key)
            found = self._here[key] = (edge, edge is not None and self.rank in edge.adapter.devices
                                       and self._at_consumer(key))
        return found

    def _sends(self, op: str) -> list[tuple[Edge, tuple[str, str, int]]]:
        """The edges ``op`` feeds whose adapter this rank writes right after it (it takes part
        but holds no part of the consumer's stage: a send to a later stage), once per rank."""
        found = self._sends_of.get(op)
        if found is None:
            found = self._sends_of[op] = [
                (self.m.edges[key], key) for key in self.c.after.get(op, ())
                if self.rank in self.m.edges[key].adapter.devices and not self._at_consumer(key)]
        return found

    def _at_consumer(self, key: tuple[str, str, int]) -> bool:
        return self.rank in self.c.stage_devices[self.t.stage(key[1])]

    def _input(self, op: Op, slot: int, name: str, part: Part | None, unit: str, stage: int,
               mb: int) -> str | None:
        key = (name, op.name, slot)
        edge, mine = self._edge_here(key)
        if edge is not None:
            if not mine:
                return None
            # one adapter per edge serves every part here: written where the first needs it
            if (key, mb) not in self.edge_outs:
                self.edge_outs[(key, mb)] = self._adapter(edge, key, unit, mb, part)
            outs = self.edge_outs[(key, mb)]
            if not outs or part is None or part.sub.inputs[slot] is None:
                return None
            return outs[self._readers(op.name, slot).index(part)]
        if part is None or part.sub.inputs[slot] is None:
            return None
        return self._source(name, op.name, slot, mb, unit, part)

    def _source(self, name: str, op: str, slot: int, mb: int, unit: str, part: Part) -> str:
        use = self.m.sources[(name, op, slot, self.rank, part.index)]
        g = self.graph
        is_input = name in g.inputs
        # a take inside a recomputed region serves that region only: it is never one of the
        # region's results (co-shard: the next part's region takes its own)
        region = self.n_regions if self.region_start is not None else -1
        key = (name, use.region, use.scale, mb if is_input else -1, self.seg.index, region)
        if key in self.takes:
            return self.takes[key]
        n = self.take_ids.setdefault(key[:4] + key[5:], len(self.take_ids))
        value = f"{name}#{n}|{self.seg.index}"
        span = part.assigned_at or part.span
        if is_input:
            boxes = self.t.input_boxes.get(name)
            box = boxes[mb] if boxes is not None else None
            ins: Any = TakeInput(value, g.inputs.index(name), box, use.region, span=span)
        elif name in g.params:
            ins = TakeParam(value, name, use.region, use.scale, span=span)
            self.weight_dep.add(value)
            b = self.z3.get((name, use.region))
            if b is not None:
                self.holds[value] = frozenset({b})
                self._used(self.holds[value], ins)
        else:
            ins = TakeBuffer(value, name, use.region, span=span)
            self.neutral.add(value)
        self.out.append(ins)
        self.sites[id(ins)] = ("take", name, op, slot, self._position(op, part))
        self.takes[key] = value
        self._define(value, unit)
        self.leaves.add(value)  # takes are leaves (or views of leaves): no cut needed
        return value

    def _adapter(self, edge: Edge, key, unit: str, mb: int, part: Part | None
                 ) -> tuple[str, ...] | None:
        """Write edge ``key``'s adapter for this rank; the values of its consumer slots here
        (one per part of the consumer that reads the edge), or None when it consumes none."""
        ad = edge.adapter
        producer_op = self.c.producer[edge.tensor].name
        produced = tuple(self._value(edge.tensor, producer_op, p, mb)
                         for p in self.c.placed.get((producer_op, self.rank), ()))
        is_producer, is_consumer, n_out, shapes, _ = self._roles(ad)
        if self._passthrough(ad):
            # slot for slot; a later part's value (co-shard, part by part) is not made yet:
            # its reader takes it (or a cut of it) when it runs
            return tuple(self._use(v, unit) if v in self.defined_in else v
                         for v in produced) if is_consumer else None
        eid = self.c.edge_ids[key]
        base = eid * self.t.microbatches + mb
        fwd = stamp(self._view(ad), 2 * base, self.c.stride)
        back = stamp(self._view(ad.backward), 2 * base + 1, self.c.stride) if _has_grad(ad) \
            else ()
        outs = tuple(f"{edge.tensor}>{edge.op}.{edge.slot}{'' if n_out == 1 else f'~{j}'}@{mb}"
                     for j in range(n_out))
        span = self._edge_span(edge, part)
        if not moves(fwd) and not moves(back):
            if not is_consumer:
                return None  # nothing leaves this rank and nothing arrives
            ins = tuple(self._use(v, unit) for v in produced) if is_producer else ()
            self.out.append(LocalAdapter(eid, ins, outs, fwd, back, span=span))
            self.sites[id(self.out[-1])] = ("local", ad, 2 * base)
            if self.z3:
                self._flow(ins, outs, self.out[-1])
            for o in outs:
                self._define(o, unit)
            self._sides(ins, outs)
            return outs
        ins = produced if is_producer else ()
        for v in ins:
            if v not in self.defined_in:
                raise AssertionError(f"rank {self.rank}: {v} is sent before it is made")
        # floats of the traced dtype travel in the run's dtype, chosen when the program runs (a
        # compiled program serves float32 and float64 runs alike); a tensor the model keeps in
        # another precision (rotary tables cast to float32 in a float64 run) and integers travel
        # as they are, so that sender and receiver agree on the bytes
        dtype = "float" if ad.dtype == self.m.dtype else str(ad.dtype).removeprefix("torch.")
        comm = Comm(eid, mb, False, ins, outs, shapes, dtype, fwd, grad=_has_grad(ad), span=span)
        self._close_region()
        self.out.append(comm)
        self.sites[id(comm)] = ("comm", ad, 2 * base)
        if self.z3:
            self._flow(ins, (), comm)
        for v in ins if _has_grad(ad) else ():
            src = self.defined_in[v]
            if v not in src.roots:
                src.roots.append(v)
        self.forward_items[unit].append(_Point(comm, key))
        self._new_segment(unit, span)
        for o in outs:
            self._define(o, unit)
            self.leaves.add(o)
            if _has_grad(ad):
                self.uncollected.add(o)
                self.activation_side.add(o)
        return outs or None

    def _edge_span(self, edge: Edge, part: Part | None) -> Span | None:
        key = (edge.tensor, edge.op, edge.slot, None if part is None else id(part))
        if key not in self._spans:  # parts and edges outlive this rank's lowering
            self._spans[key] = self._first_span(edge, part)
        return self._spans[key]

    def _first_span(self, edge: Edge, part: Part | None) -> Span | None:
        mine = self.c.first(edge.op, self.rank) or part
        for p in (mine, self.c.first(self.c.producer[edge.tensor].name, self.rank),
                  self.t.parts[edge.op][0]):
            if p is not None and (p.assigned_at or p.span) is not None:
                return p.assigned_at or p.span
        return None

    def _call(self, op: Op, part: Part, local: Sequence[str | None], unit: str, mb: int,
              chunk: int | None = None) -> None:
        ins = tuple(None if v is None else self._use(v, unit) for v in local)
        span = self.c.recompute.get(op.name)
        if span is not None and self.region_start is None:
            self.region_start = len(self.out)
            self.region_span = span
            self.region_chunk = chunk  # a co-sharded part's region holds that part only
            self.n_regions += 1
            self.out.append(RecomputeBegin((), (), span=span))
            if self.seg is not None:
                self.seg.recomputed = True
        elif span is None:
            self._close_region()
        outs = tuple(self._value(x, op.name, part, mb) for x in op.outputs)
        if self.split or unit in self.split_units:
            ins = self._weight_cuts(ins, outs, unit, part)
        is_loss = self.graph.output in op.outputs
        own = self.c.own_loss
        counted = is_loss and (not any(part.replica_index) if own is None
                               else part.index in own[self.rank])
        self.out.append(Call(op.name, part.index, outs, ins, part.sub.local,
                             op.returns == "list", is_loss, counted,
                             span=part.span or part.assigned_at))
        self.sites[id(self.out[-1])] = ("call", self._position(op.name, part))
        for o in outs:
            self._define(o, unit)
        if self.z3:
            self._flow(ins, outs, self.out[-1])
        if is_loss:
            self.seg.seeds.append(outs[op.outputs.index(self.graph.output)])

    def _sides(self, ins: Sequence[str | None], outs: Sequence[str]) -> None:
        """Outputs are on the side of any of their inputs (a split backward's two sides)."""
        if any(v in self.activation_side for v in ins if v is not None):
            self.activation_side.update(outs)
        if any(v in self.weight_dep for v in ins if v is not None):
            self.weight_dep.update(outs)

    def _weight_side(self, value: str) -> bool:
        return value in self.weight_dep and value not in self.activation_side

    def _weight_cuts(self, ins: tuple[str | None, ...], outs: tuple[str, ...], unit: str,
                     part: Part) -> tuple[str | None, ...]:
        """A call that mixes the two sides reads its weight-side inputs through weight cuts, one
        per input (a cut shared by two calls would send one call's gradient through the other's
        in the weight half); the segment remembers the call for ``BackwardWeight``."""
        self._sides(ins, outs)
        if not any(v in self.activation_side for v in ins if v is not None):
            return ins
        if self.region_start is not None:
            raise AssertionError("a split backward with recompute is refused before lowering")
        new, cuts = list(ins), []
        for i, v in enumerate(ins):
            if v is not None and self._weight_side(v):
                cut = f"{v}|w{self.n_weight_cuts}"
                self.n_weight_cuts += 1
                self.out.append(Cut(cut, v, span=part.span or part.assigned_at))
                self.made[unit].append(cut)
                new[i] = cut
                cuts.append((cut, v))
        if cuts:
            self.seg.mixes.append((outs, tuple(cuts)))
            made = {c for c, _ in cuts}
            self.seg.mix_inputs.extend(v for v in new if v is not None and v not in made)
        return tuple(new)

    # -- recompute regions ----------------------------------------------------------------------------
    def _close_region(self) -> None:
        if self.region_start is not None:
            self.out.append(RecomputeEnd(span=self.region_span))
            self.region_start = None

    # -- backward ---------------------------------------------------------------------------------
    def _backward(self, unit: str, stage: int, mb: int, span: Span | None) -> None:
        forward = f"{stage}F{mb}"
        items = self.forward_items.get(forward)
        if items is None:
            return  # the checker names a backward without its forward
        if forward in self.split_units:  # its input half, what it sends, then its weight half
            self._input_grad(stage, mb, span)
            if forward in self.deferred_w:  # DEFER_W: after the rank's last backward's
                self.pending_w.append((stage, mb, span))
            else:
                self._weight_grad(stage, mb, span)
            return
        runs = [it for it in reversed(items) if isinstance(it, _Segment)
                and (it.seeds or it.roots or it.collect)]
        last = {b: k for k, it in enumerate(runs) for b in it.buckets}
        kept = self.kept[1] if self.kept[0] == forward else frozenset()
        gathered: set[int] = set(kept)  # still gathered from the forward
        waited: set[int] = set(kept)
        final = self.last_backward.get(stage) == unit
        first = self._sent_first(unit, items, runs)
        for item in reversed(items):
            if isinstance(item, _Segment):
                # a segment may hold only cuts that a later segment reads (a weight cut after
                # one communication point of its consumer's inputs and before the next): its
                # backward runs no autograd but must still collect their gradients
                if item.seeds or item.roots or item.collect:
                    k = runs.index(item)
                    self._regather(item, runs[k + 1:], gathered, waited)
                    args = (tuple(item.seeds), tuple(item.roots), tuple(item.collect))
                    if item is first:
                        self.out.append(Backward(*args, part="sent", span=item.span or span))
                        continue  # the rest, and the buckets it releases, after the sends
                    self.out.append(Backward(*args, span=item.span or span))
                    for b in sorted(b for b in item.buckets if last[b] == k):
                        self._release(b, final)
            else:
                self._backward_comm(item)
        if first is not None:
            k = runs.index(first)
            self.out.append(Backward(tuple(first.seeds), tuple(first.roots),
                                     tuple(first.collect), part="rest", span=first.span or span))
            for b in sorted(b for b in first.buckets if last[b] == k):
                self._release(b, final)
        self.out.append(Free(tuple(self.made.get(forward, ())), span=span))

    def _split_last(self) -> frozenset[str]:
        """The forward units whose backward this rank splits into its input and weight halves
        although the plan asks for whole backwards: the forward of the rank's last backward
        unit, where that stage's backward sends gradients to another device. The stage before
        waits for them while nothing here does, and after this unit no forward is left to
        hide the wait: the input half computes them and they leave, then the weight half
        computes the weights' gradients from the gradients the input half kept (one walk in
        all, as ``I`` and ``W`` units of a zero-bubble plan run, so it costs a whole backward's
        work). The forward reads the weights of its mixing calls through weight cuts for it.
        Not with ``recompute`` (a split backward refuses it), nor ZeRO stage 3 (its buckets
        follow whole backwards: ``_sent_first`` walks those twice instead). Unlike that second
        walk, it adds no work: it stays where the ranks share cores (``Materialized.send_first``
        False; on the peers' 1f1b, 4 ranks on 2 cores, the step 0.974 times as long as with the
        two walks and 0.976 as with none).

        With ``DEFER_W``, where the ranks have cores of their own (``Materialized.send_first``:
        each split costs CPU, about 0.6 ms a backward on the peers' GPT, which ranks that share
        cores pay in time), a rank whose first stage k sends gradients back also splits its
        first k backward units and runs their weight halves after the last one's
        (``deferred_w``, ``_backward``)."""
        unit = self.device_last_backward
        if (not (SEND_FIRST and SPLIT_LAST) or self.split
                or unit is None or self.z3 or self.c.recompute):
            return frozenset()
        stage, _, mb = _split_unit(unit)
        last = f"{stage}F{mb}"
        split = {last} if self._stage_sends_back(stage) else set()
        if DEFER_W and self.m.send_first:
            backwards = [(st, k) for st, pass_, k in (_split_unit(u) for u, _ in self._units)
                         if pass_ == "B"]
            first = min(st for st, _ in backwards)
            early = [f"{st}F{k}" for st, k in backwards
                     if self._stage_sends_back(st)][:first]
            self.deferred_w = frozenset(u for u in early if u != last)
            split |= self.deferred_w
        return frozenset(split)

    def _stage_sends_back(self, stage: int) -> bool:
        """Whether stage ``stage``'s backward on this rank sends gradients to another device."""
        known = self._sends_back_stage.get(stage)
        if known is not None:
            return known
        found = False
        for op, part, _, _ in self._steps(stage):
            if part is None:
                continue
            for slot, name in enumerate(op.inputs):
                edge, mine = self._edge_here((name, op.name, slot))
                if edge is not None and mine and self._sends_back(edge.adapter):
                    found = True
                    break
            if found:
                break
        self._sends_back_stage[stage] = found
        return found

    def _sent_first(self, unit: str, items: list, runs: list[_Segment]) -> _Segment | None:
        """The segment whose backward this unit runs in two walks (``Backward.part``), or None:
        in this rank's last backward unit, the segment nearest the unit's inputs, when the
        gradients it collects are what the unit sends on and nothing but communication follows
        its backward. The stage before waits for those gradients while nothing here does: the
        first walk computes them alone and they leave before the second walk computes the
        weights' gradients (walking the graph again), so the wait down the pipeline shrinks
        from a whole backward to an input-gradient one. Not where the segment's calls are
        recomputed in backward (a second walk would recompute them again), and not where the
        job's ranks share cores (``Materialized.send_first``)."""
        if (not (SEND_FIRST and self.m.send_first) or self.split
                or unit != self.device_last_backward or not runs):
            return None
        seg = runs[-1]  # reversed: the last one to run
        if not seg.collect or seg.recomputed or (not seg.seeds and not seg.roots):
            return None
        after = items[:items.index(seg)]  # before it in the forward: after it in backward
        if any(isinstance(it, _Segment) and (it.seeds or it.roots or it.collect)
               for it in after):
            return None
        if not any(isinstance(it, _Point) and self._sends_back(self.m.edges[it.key].adapter)
                   for it in after):
            return None  # its gradients go to no other device: nobody waits for them
        return seg

    def _sends_back(self, ad: Adapter) -> bool:
        """Whether this rank sends another device gradients in ``ad``'s backward."""
        return _has_grad(ad) and any(
            m.src == self.rank and m.dst != self.rank
            for step in ad.backward.steps if isinstance(step, PointToPoint)
            for m in step.messages)

    def _regather(self, seg: _Segment, later: list[_Segment], gathered: set[int],
                  waited: set[int]) -> None:
        """Before ``seg``'s backward: its buckets gathered (unless prefetched) and waited for,
        and those of the next segment that needs others prefetched."""
        for b in sorted(seg.buckets - gathered):
            self._gather(b, gathered)
        for b in sorted(seg.buckets - waited):
            self.out.append(WaitParams(b, span=self.m.reducer.buckets[b].span))
            waited.add(b)
        nxt = next((s for s in later if s.buckets - gathered), None)
        for b in sorted(nxt.buckets - gathered) if nxt is not None else ():
            self._gather(b, gathered)

    def _release(self, b: int, final: bool) -> None:
        """After bucket ``b``'s last backward in this unit: free it; in the last backward unit
        of its stage, its gradient is whole: reduce-scatter it now."""
        bucket = self.m.reducer.buckets[b]
        self.out.append(FreeParams(b, span=bucket.span))
        if final and b not in self.reduced:
            self.reduced.add(b)
            self.out.append(ReduceBucket(b, tuple(bucket.devices), tuple(bucket.entries),
                                         span=bucket.span, zero=bucket.zero))

    def _input_grad(self, stage: int, mb: int, span: Span | None) -> None:
        """An ``I`` unit: the backward unit's communication, with each segment's autograd over
        its activation side only; nothing is freed (the ``W`` unit needs the graph)."""
        items = self.forward_items.get(f"{stage}F{mb}")
        if items is None:
            return  # the checker names a unit without its forward
        for item in reversed(items):
            if isinstance(item, _Segment):
                seeds = tuple(v for v in item.seeds if not self._weight_side(v))
                roots = tuple(v for v in item.roots if not self._weight_side(v))
                keep = tuple(o for outs, _ in item.mixes for o in outs)
                if seeds or roots or item.collect:
                    self.out.append(BackwardInput(seeds, roots, tuple(item.inputs),
                                                  tuple(item.collect), keep,
                                                  span=item.span or span))
            else:
                self._backward_comm(item)

    def _weight_grad(self, stage: int, mb: int, span: Span | None) -> None:
        """A ``W`` unit: each segment's weight side, then the ``Free`` of the forward's values."""
        forward = f"{stage}F{mb}"
        items = self.forward_items.get(forward)
        if items is None:
            return
        for item in reversed(items):
            if isinstance(item, _Segment):
                seeds = tuple(v for v in item.seeds if self._weight_side(v))
                roots = tuple(v for v in item.roots if self._weight_side(v))
                if seeds or roots or item.mixes:
                    self.out.append(BackwardWeight(seeds, roots, tuple(item.mixes),
                                                   tuple(dict.fromkeys(item.mix_inputs)),
                                                   span=item.span or span))
        self.out.append(Free(tuple(self.made.get(forward, ())), span=span))

    def _backward_comm(self, point: _Point) -> None:
        c = point.comm
        ad = self.m.edges[point.key].adapter
        if not _has_grad(ad):
            return
        base = c.edge * self.t.microbatches + c.mb
        steps = stamp(self._view(ad.backward), 2 * base + 1, self.c.stride)
        shapes = self._roles(ad)[4]
        self.out.append(Comm(c.edge, c.mb, True, c.outs, c.ins, shapes, c.dtype, steps,
                             span=c.span))
        self.sites[id(self.out[-1])] = ("comm", ad.backward, 2 * base + 1)


def _free_forward_only(out: list[Any], made: dict[str, list[str]]) -> list[Any]:
    """A forward-only unit has no backward to free its values: free, at its ``End``, those that
    no later instruction reads (what it sends on, or a later unit of this rank reads, stays)."""
    frozen = {ins.unit for ins in out if isinstance(ins, Begin) and not ins.grad}
    if not frozen:
        return out
    last: dict[str, int] = {}
    for i, ins in enumerate(out):
        for v in reads(ins):
            last[v] = i
    result: list[Any] = []
    for i, ins in enumerate(out):
        if isinstance(ins, End) and ins.unit in frozen:
            dead = tuple(v for v in made.get(ins.unit, ()) if last.get(v, -1) <= i)
            if dead:
                result.append(Free(dead, span=ins.span))
        result.append(ins)
    return result


def _split_unit(unit: str) -> tuple[int, str, int]:
    for i, ch in enumerate(unit):
        if ch.isalpha():
            return int(unit[:i]), ch, int(unit[i + 1:])
    raise ValueError(f"not a unit: {unit!r}")


def _fill_recompute(out: list[Any]) -> list[Any]:
    """Give each ``RecomputeBegin`` the values its region reads from outside and the values it
    makes that anything after it reads; drop regions without calls."""
    if not any(isinstance(ins, RecomputeBegin) for ins in out):
        return list(out)
    used_at: dict[str, list[int]] = {}
    for i, ins in enumerate(out):
        for v in reads(ins):
            used_at.setdefault(v, []).append(i)
        if isinstance(ins, Comm) and ins.backward:
            for v in ins.ins:
                used_at.setdefault(v, []).append(i)
    result = list(out)
    i = 0
    while i < len(result):
        if isinstance(result[i], RecomputeBegin):
            j = i + 1
            while not isinstance(result[j], RecomputeEnd):
                j += 1
            inside = result[i + 1:j]
            made = {v for x in inside for v in writes(x)}
            ins = tuple(dict.fromkeys(v for x in inside for v in reads(x) if v not in made))
            outs = tuple(v for x in inside for v in writes(x)
                         if any(k > j for k in used_at.get(v, ())))
            result[i] = attrs.evolve(result[i], ins=ins, outs=outs)
            i = j
        i += 1
    return result
