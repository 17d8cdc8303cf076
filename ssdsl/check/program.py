"""Checking the lowered per-rank programs themselves: what is checked is what runs.

``check_programs`` reads only the instructions (and, given the materialized plan, the schedule
and buckets they were lowered from):

1. *Structure* of each rank's program: units open and close in turn, each at most once, a
   backward (or input-gradient unit) after its forward, a weight-gradient unit after its
   input-gradient unit, in the order the plan's ``order`` statements gave; recomputed
   regions close and contain no communication; the step ends with its buckets, the loss sum and
   one optimizer step, followed only by the all-gather of each ZeRO-sharded bucket (stages 1
   and 2; a stage-3 bucket reduce-scatters inside its backward unit and is not gathered after
   the step).
2. *Data*: every value an instruction reads was defined earlier on that rank and not freed;
   a backward ``Comm`` follows its forward. Under ZeRO stage 3 the weights of a bucket are read
   only while it is gathered: a ``GatherParams`` and its ``WaitParams`` before, no
   ``FreeParams`` since; that holds for the calls that read them (or a view of them) in forward
   and for every call a ``Backward`` reaches through autograd (the tensors it saved are the
   weights); every gather is freed before the step ends, none twice; a bucket's gradient is
   reduce-scattered only after the last backward that reaches its weights.
3. *Communication*: every rank's walk runs in this process with abstract payloads
   (``ssdsl.lower.walk.run_all``): every send meets exactly one receive of the same tag and
   shape, every collective is issued by all members of its group in the same order, and the
   ranks cannot deadlock (sends never block; a collective is a meeting point of its group).
4. *Gradient sums*: where the copies of a weight hold overlapping but unequal regions (a
   partition nested in one part of a data-parallel split), every piece of it that several ranks
   hold (``ssdsl.materialize.reducer.holder_pieces``) has its gradient summed over exactly those
   ranks by their ``reduce`` instructions: otherwise each rank steps on its own share of the
   gradient. (Copies with equal regions are left to the reducer: replicas that compute the
   same whole gradient, as Megatron's layer norms, need no sum.) The walk of 3 notes on its way
   the regions the programs take.

Every error names the plan line behind the offending instruction.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ssdsl.forking import Forked, can_fork, usable_cores
from ssdsl.lower import Handler, Program, Wait, run_all, walk
from ssdsl.lower.build import unit_order
from ssdsl.lower.instr import Coll, P2P, reads, writes
from ssdsl.lower.walk import (CollectiveMismatch, Exchange, MessageMismatch, ProgramDeadlock,
                              ProgramError, UnmatchedSend)
from ssdsl.materialize.reducer import holder_pieces
from ssdsl.source import Span


class BadUnitStructure(ProgramError):
    """Units that do not open and close in turn, repeat, or run a backward before its forward."""


class OrderNotFollowed(ProgramError):
    """A rank's units run in another order than the plan's schedule says."""


class UndefinedValue(ProgramError):
    """An instruction reads a value that no earlier instruction of its rank defined (or that was
    freed)."""


class RecomputeCommunicates(ProgramError):
    """A recomputed region contains communication (recomputing would communicate twice)."""


class BadStepTail(ProgramError):
    """The step does not end with its gradient buckets, the loss sum and one optimizer step."""


class ParamsNotGathered(ProgramError):
    """ZeRO stage 3: an instruction reads the weights of a bucket that is not gathered there
    (never gathered, not yet waited for, or already freed)."""


class GatherNotFreed(ProgramError):
    """ZeRO stage 3: a bucket gathered and never freed, gathered again while gathered, or freed
    or waited for without a gather."""


class GradientNotSummed(ProgramError):
    """A piece of a weight that several ranks hold, as copies whose regions overlap unequally,
    whose gradient no ``reduce`` sums over exactly those ranks."""


__all__ = ["BadStepTail", "BadUnitStructure", "CollectiveMismatch", "GatherNotFreed",
           "GradientNotSummed", "MessageMismatch", "OrderNotFollowed", "ParamsNotGathered",
           "ProgramDeadlock", "ProgramError", "RecomputeCommunicates", "UndefinedValue",
           "UnmatchedSend", "check_programs"]


# a plan whose programs hold at least this many instructions in all has each program's own
# checks (structure, data, gathered weights) run in forked processes, while this one walks
# their communication (a 1,024-rank GPT-3 plan: 4.6 million instructions)
FORK_INSTRUCTIONS = 200_000


def check_programs(programs: Sequence[Program], *, m: Any = None, jobs: int | None = None
                   ) -> None:
    """Raise the first fault of ``programs`` (one per rank) as a ``ProgramError`` at its plan
    line; with ``m`` (the ``Materialized`` they come from) also check the unit order against
    its schedule and the buckets against its reducer.

    The first fault is the first rank's (in order) whose own program is faulty, else the
    first the walk of their communication meets. Large plans (``FORK_INSTRUCTIONS``) check
    the programs in ``jobs`` forked processes (default: the cores this process may use), each
    a run of consecutive ranks, while this process walks their communication; the fault
    raised is the same."""
    programs = tuple(programs)
    jobs = usable_cores() if jobs is None else jobs
    try:
        if jobs > 1 and can_fork() and len(programs) >= 2 and \
                sum(len(p.instructions) for p in programs) >= FORK_INSTRUCTIONS:
            _check_forked(programs, m, min(jobs, len(programs)))
        else:
            for p in programs:
                _own(p, m)
            _weight_sums(programs, _communication(programs))
    except ProgramError as err:
        if err.span is None:
            err.span = _any_span(programs)
        raise


def _own(p: Program, m: Any) -> None:
    """The checks of one rank's program on its own (1 and 2 of the module docstring)."""
    _structure(p, m)
    _data(p)
    _gathered_params(p)


def _check_forked(programs: tuple[Program, ...], m: Any, jobs: int) -> None:
    bounds = [len(programs) * k // jobs for k in range(jobs + 1)]
    forked = Forked([functools.partial(_first_own_fault, programs, m, lo, hi)
                     for lo, hi in zip(bounds, bounds[1:])], what="checking programs")
    try:
        held = _communication(programs)
        late = None
    except Exception as exc:  # noqa: BLE001 - a rank's own fault comes first (docstring)
        late = exc
    for fault in forked.results():
        if fault is not None:
            raise fault
    if late is not None:
        raise late
    _weight_sums(programs, held)


def _first_own_fault(programs: tuple[Program, ...], m: Any, lo: int, hi: int
                     ) -> ProgramError | None:
    """The first fault of ``programs[lo:hi]`` on their own, or None (in a forked process)."""
    for p in programs[lo:hi]:
        try:
            _own(p, m)
        except ProgramError as err:
            return err
    return None


def _any_span(programs: Sequence[Program]) -> Span | None:
    for p in programs:
        for ins in p.instructions:
            if getattr(ins, "span", None) is not None:
                return ins.span
    return None


def _near(p: Program, i: int) -> Span | None:
    """The span of instruction ``i``, else of the nearest instruction before or after it."""
    for j in [*range(i, -1, -1), *range(i + 1, len(p.instructions))]:
        span = getattr(p.instructions[j], "span", None)
        if span is not None:
            return span
    return None


# -- 1. structure --------------------------------------------------------------------------------


def _structure(p: Program, m: Any) -> None:
    open_unit: str | None = None
    seen: set[str] = set()
    region = False
    units: list[tuple[str, int]] = []
    tail = False
    steps = 0
    for i, ins in enumerate(p.instructions):
        k = ins.kind
        where = f"rank {p.rank}"
        if k == "begin":
            if open_unit is not None or ins.unit in seen:
                what = "runs twice" if ins.unit in seen else f"starts inside unit {open_unit}"
                raise BadUnitStructure(f"{where}: unit {ins.unit} {what}", _near(p, i))
            for later, first, name in (("B", "F", "forward"), ("I", "F", "forward"),
                                       ("W", "I", "input-gradient unit")):
                if later in ins.unit and ins.unit.replace(later, first) not in seen:
                    raise BadUnitStructure(f"{where}: unit {ins.unit} runs before its {name} "
                                           f"{ins.unit.replace(later, first)}", _near(p, i))
            if tail:
                raise BadStepTail(f"{where}: unit {ins.unit} runs after the optimizer step "
                                  "or the gradient buckets", _near(p, i))
            open_unit = ins.unit
            seen.add(ins.unit)
            units.append((ins.unit, i))
        elif k == "end":
            if open_unit != ins.unit:
                raise BadUnitStructure(f"{where}: end of unit {ins.unit} while "
                                       f"{open_unit or 'no unit'} is open", _near(p, i))
            if region:
                raise RecomputeCommunicates(f"{where}: a recomputed region is still open at "
                                            f"the end of unit {ins.unit}", _near(p, i))
            open_unit = None
        elif k == "recompute":
            region = True
        elif k == "end_recompute":
            region = False
        elif k in ("comm", "backward", "backward_input", "backward_weight", "reduce", "loss_sum",
                   "step", "wait_sends", "gather", "gather_params", "wait_params",
                   "free_params") and region:
            raise RecomputeCommunicates(
                f"{where}: a recomputed region holds a {k} instruction: recomputing it in "
                "backward would run it twice", _near(p, i),
                hint="recompute only operators between two communication points")
        elif k == "reduce" and ins.zero == 3 and open_unit is not None:
            pass  # stage 3: reduce-scattered in backward, after the bucket's last use
        elif k in ("reduce", "loss_sum", "wait_sends", "step", "gather"):
            if open_unit is not None:
                raise BadStepTail(f"{where}: {k} inside unit {open_unit}", _near(p, i))
            if steps and k != "gather":
                raise BadStepTail(f"{where}: {k} after the optimizer step (only the all-gathers "
                                  "of sharded buckets follow it)", _near(p, i))
            if k == "gather" and not steps:
                raise BadStepTail(f"{where}: the all-gather of sharded bucket {ins.bucket} "
                                  "before the optimizer step: it would gather chunks not yet "
                                  "updated", _near(p, i))
            tail = True
            steps += k == "step"
        elif k not in ("wait_sends",) and open_unit is None and k not in ("free",):
            raise BadUnitStructure(f"{where}: a {k} instruction outside every unit",
                                   _near(p, i))
    if open_unit is not None:
        raise BadUnitStructure(f"rank {p.rank}: unit {open_unit} never ends",
                               _near(p, len(p.instructions) - 1))
    if steps != 1:
        raise BadStepTail(f"rank {p.rank}: the step must end with exactly one optimizer step "
                          f"(found {steps})", _near(p, len(p.instructions) - 1))
    _sharded(p)
    sums = sum(ins.kind == "loss_sum" or (ins.kind == "reduce" and ins.loss)
               for ins in p.instructions)
    if sums != 1:
        raise BadStepTail(f"rank {p.rank}: the step's loss must be summed exactly once "
                          f"(found {sums})", _near(p, len(p.instructions) - 1))
    if m is not None:
        _order(p, m, units)
        _buckets(p, m)


def _order(p: Program, m: Any, units: list[tuple[str, int]]) -> None:
    want = unit_order(m, p.rank)
    got = [u for u, _ in units]
    for k, (unit, span) in enumerate(want):
        if k >= len(got):
            raise OrderNotFollowed(f"rank {p.rank} never runs unit {unit}", span or _near(p, 0))
        if got[k] != unit:
            i = units[k][1]
            raise OrderNotFollowed(f"rank {p.rank} runs unit {got[k]} where the plan's order "
                                   f"puts {unit}", span or _near(p, i))
    if len(got) > len(want):
        i = units[len(want)][1]
        raise OrderNotFollowed(f"rank {p.rank} runs unit {got[len(want)]}, which the plan's "
                               "order does not give it", _near(p, i))


def _sharded(p: Program) -> None:
    """Each ZeRO-sharded bucket is gathered once after the step, from the group it was reduced
    over; nothing else is gathered (a missing gather leaves the other chunks stale)."""
    reduced = {ins.bucket: (i, ins) for i, ins in enumerate(p.instructions)
               if ins.kind == "reduce" and ins.zero in (1, 2)}
    gathered: dict[int, int] = {}
    for i, ins in enumerate(p.instructions):
        if ins.kind != "gather":
            continue
        red = reduced.get(ins.bucket)
        if red is None or ins.bucket in gathered or red[1].group != ins.group \
                or red[1].entries != ins.entries:
            why = ("twice" if ins.bucket in gathered else "without sharding it" if red is None
                   else "over another group or other weights than it was reduced")
            raise BadStepTail(f"rank {p.rank} gathers bucket {ins.bucket} {why}", _near(p, i))
        gathered[ins.bucket] = i
    for bucket, (i, _) in sorted(reduced.items()):
        if bucket not in gathered:
            raise BadStepTail(f"rank {p.rank} steps only its chunk of sharded bucket {bucket} "
                              "and never gathers the others' chunks", _near(p, i),
                              hint="a GatherBucket after the optimizer step rebuilds them")


def _buckets(p: Program, m: Any) -> None:
    want = [i for i, b in enumerate(m.reducer.buckets) if p.rank in b.devices]
    got = [(i, ins) for i, ins in enumerate(p.instructions) if ins.kind == "reduce"]
    have = [ins.bucket for _, ins in got]
    if sorted(have) != want:
        missing = sorted(set(want) - set(have))
        raise BadStepTail(f"rank {p.rank} reduces gradient buckets {have}, the plan needs "
                          f"{want}" + (f" (bucket {missing[0]} is missing)" if missing else ""),
                          _near(p, got[0][0] if got else len(p.instructions) - 1))
    for i, ins in got:
        stage = m.reducer.buckets[ins.bucket].zero
        if ins.zero != stage:
            raise BadStepTail(f"rank {p.rank} reduces bucket {ins.bucket} at ZeRO stage "
                              f"{ins.zero}, the plan says {stage}", _near(p, i))


# -- 2. data ---------------------------------------------------------------------------------------


def _data(p: Program) -> None:
    defined: set[str] = set()
    covers = defined.issuperset
    for i, ins in enumerate(p.instructions):
        needed = reads(ins)
        kind = ins.kind
        if kind == "comm" and ins.backward:
            needed = (*needed, *ins.ins, *ins.outs)
        if needed and not covers(needed):
            v = next(v for v in needed if v not in defined)
            raise UndefinedValue(f"rank {p.rank}: a {kind} instruction reads '{v}', "
                                 "which is not defined before it (or was freed)",
                                 _near(p, i),
                                 hint="a unit runs before the data it needs")
        made = writes(ins)
        if made:
            defined.update(made)
        if kind == "free":
            defined.difference_update(ins.values)


_LEAVES = frozenset({"cut", "param", "input", "buffer"})


def _gathered_params(p: Program) -> None:
    """ZeRO stage 3: weights are read only while their bucket is gathered (module docstring)."""
    bucket_of = {e: ins.bucket for ins in p.instructions
                 if ins.kind == "gather_params" or (ins.kind == "reduce" and ins.zero == 3)
                 for e in ins.entries}
    if not bucket_of:
        return
    state: dict[int, str] = {}  # bucket -> "in flight" | "ready"; absent: not gathered
    since: dict[int, int] = {}  # bucket -> where its gather or free stands
    reduced: dict[int, int] = {}
    holds: dict[str, frozenset[int]] = {}
    made_by: dict[str, int] = {}
    neutral: set[str] = set()
    where = f"rank {p.rank}"

    def need(buckets, i: int, what: str) -> None:
        for b in sorted(buckets):
            if state.get(b) != "ready":
                why = {"in flight": "its gather was not waited for",
                       None: "it is not gathered" if b not in since else
                       f"it was freed at instruction {since[b]}"}[state.get(b)]
                raise ParamsNotGathered(f"{where}: {what} reads the weights of ZeRO-3 bucket "
                                        f"{b}, but {why}", _near(p, i),
                                        hint="GatherParams and WaitParams before the first use "
                                        "of a bucket, FreeParams after its last")
            if b in reduced:
                raise BadStepTail(f"{where}: {what} still adds to the gradient of bucket {b}, "
                                  f"which was reduce-scattered at instruction {reduced[b]}",
                                  _near(p, i))

    for i, ins in enumerate(p.instructions):
        k = ins.kind
        if k == "gather_params":
            if ins.bucket in state:
                raise GatherNotFreed(f"{where} gathers bucket {ins.bucket} again while it is "
                                     f"gathered (since instruction {since[ins.bucket]})",
                                     _near(p, i))
            state[ins.bucket], since[ins.bucket] = "in flight", i
        elif k == "wait_params":
            if state.get(ins.bucket) != "in flight":
                raise GatherNotFreed(f"{where} waits for bucket {ins.bucket}, which no gather "
                                     "has started", _near(p, i))
            state[ins.bucket] = "ready"
        elif k == "free_params":
            if ins.bucket not in state:
                raise GatherNotFreed(f"{where} frees bucket {ins.bucket}, which is not gathered",
                                     _near(p, i))
            del state[ins.bucket]
            since[ins.bucket] = i
        elif k == "reduce" and ins.zero == 3:
            reduced[ins.bucket] = i
        elif k == "param" and (ins.tensor, ins.region) in bucket_of:
            holds[ins.out] = frozenset({bucket_of[(ins.tensor, ins.region)]})
            need(holds[ins.out], i, f"taking {ins.tensor}")
        elif k == "buffer":
            neutral.add(ins.out)
        elif k == "backward":
            reach = _reached_calls(p, made_by, ins.seeds + ins.roots)
            need(frozenset().union(*(holds.get(v, frozenset()) for j in reach
                                     for v in reads(p.instructions[j]))), i, "a backward")
        elif k in ("call", "cut", "local", "comm") and not getattr(ins, "backward", False):
            vs = reads(ins)
            held = frozenset().union(*(holds.get(v, frozenset()) for v in vs))
            if held:
                need(held, i, f"a {k} instruction")
                if all(v in holds or v in neutral for v in vs):
                    holds.update((o, held) for o in writes(ins))
        for v in writes(ins):
            made_by.setdefault(v, i)
    for b in sorted(state):
        raise GatherNotFreed(f"{where} gathers bucket {b} and never frees it",
                             _near(p, since[b]),
                             hint="a FreeParams after the bucket's last use in each unit")


def _reached_calls(p: Program, made_by: dict[str, int], starts) -> set[int]:
    """The calls a backward from ``starts`` runs through: their producers, back to the leaves
    (cuts, takes, received values)."""
    out: set[int] = set()
    todo = [v for v in starts if v in made_by]
    seen: set[str] = set(todo)
    while todo:
        j = made_by[todo.pop()]
        ins = p.instructions[j]
        if ins.kind in _LEAVES or ins.kind == "comm" or j in out:
            continue
        out.add(j)
        for v in reads(ins):
            if v in made_by and v not in seen:
                seen.add(v)
                todo.append(v)
    return out


# -- 4. gradient sums -----------------------------------------------------------------------------


def _weight_sums(programs: Sequence[Program], held: Mapping[tuple[str, int], Any]) -> None:
    """Every piece of a weight held by several ranks as unequal, overlapping regions is summed
    over exactly its holders on each of them (4 of the module docstring). ``held``: the weight
    regions the programs take (``_Abstract.held``, gathered by the walk of their
    communication), which tell the weights to look at (usually none); a second pass reads
    their holders and sums only."""
    regions: dict[str, dict[tuple, Any]] = {}  # weight -> intervals -> a region
    for (name, _), region in held.items():
        regions.setdefault(name, {}).setdefault(region.intervals, region)
    uneven = {name: list(regs.values()) for name, regs in regions.items()
              if len(regs) > 1 and _unequal_overlap(list(regs.values()))}
    if not uneven:
        return
    holders: dict[str, dict[tuple[int, Any], Any]] = {name: {} for name in uneven}
    sums: dict[tuple[str, int], list[tuple[Any, frozenset[int]]]] = {}
    for p in programs:
        for ins in p.instructions:
            if ins.kind == "param" and ins.tensor in uneven:
                # a holder is a leaf: (rank, which region), so that no piece spans two
                regs = uneven[ins.tensor]
                i = next(j for j, r in enumerate(regs) if r.intervals == ins.region.intervals)
                holders[ins.tensor].setdefault((p.rank, i), regs[i])
            elif ins.kind == "reduce":
                group = frozenset(ins.group)
                for name, region in ins.entries:
                    if name in uneven:
                        sums.setdefault((name, p.rank), []).append((region, group))
    for name, leaves in holders.items():
        for piece, held_by in holder_pieces(list(leaves.items())):
            ranks = frozenset(r for r, _ in held_by)
            if len(ranks) < 2:
                continue
            for r, i in sorted(held_by):
                covered = sum(e.intersect(piece).numel() for e, g in sums.get((name, r), ())
                              if g == ranks)
                if covered < piece.numel():
                    raise GradientNotSummed(
                        f"ranks {sorted(ranks)} hold {piece!r} of weight '{name}' (copies "
                        f"whose regions overlap unequally), and rank {r} does not sum its "
                        "gradient over them: each would step on its own share of the gradient",
                        _param_span(next(p for p in programs if p.rank == r), name,
                                    uneven[name][i]),
                        hint="an ssdsl defect in the gradient reducer (please report it); "
                             "partitioning every part of this operator alike avoids it")


def _unequal_overlap(regions: list[Any]) -> bool:
    """Whether two of ``regions`` (of one weight, distinct) overlap."""
    return any(a.overlaps(b) for i, a in enumerate(regions) for b in regions[i + 1:])


def _param_span(p: Program, name: str, region: Any) -> Span | None:
    """The plan line of the first instruction of ``p`` that takes ``region`` of ``name``."""
    for i, ins in enumerate(p.instructions):
        if ins.kind == "param" and ins.tensor == name and ins.region.intervals == region.intervals:
            return _near(p, i)
    return None


# -- 3. communication ----------------------------------------------------------------------------


# the instruction kinds the walk of the communication looks at
_WALKED = frozenset({"comm", "reduce", "gather", "gather_params", "loss_sum", "param"})


class _Abstract(Handler):
    """A rank's communication without tensors: shapes only. On the way, the weight regions
    the programs take go into ``held`` (shared by every rank's handler, keyed by weight and
    the region's identity: the plan makes each region once) for ``_weight_sums``."""

    def __init__(self, rank: int, exchange: Exchange, held: dict[tuple[str, int], Any]
                 ) -> None:
        self.rank, self.exchange, self.held = rank, exchange, held

    def visit(self, ins: Any) -> Iterator[Wait] | None:
        k = ins.kind
        if k not in _WALKED:  # most instructions (calls, backwards): one look-up, not six
            return None
        if k == "comm":
            return self._comm(ins)
        if k == "reduce":
            return self._meet(Coll(ins.collective, ins.group), ins,
                              ("reduce", ins.bucket, ins.loss))
        if k == "gather":
            return self._meet(Coll("all_gather", ins.group), ins, ("gather", ins.bucket))
        if k == "gather_params":
            return self._meet(Coll("all_gather", ins.group), ins, ("gather_params", ins.bucket))
        if k == "loss_sum":
            return self._meet(Coll("all_reduce", ins.group), ins, ("loss",))
        if k == "param":
            self.held[(ins.tensor, id(ins.region))] = ins.region
        return None

    def _meet(self, coll: Coll, ins: Any, ident: tuple) -> Iterator[Wait]:
        if coll.meets or self.rank not in coll.group:
            yield Wait(self.rank, coll, ins, ident)

    def _comm(self, ins: Any) -> Iterator[Wait]:
        ident = ("comm", ins.edge, ins.mb, ins.backward)
        for step in ins.steps:
            if isinstance(step, Coll):
                yield from self._meet(step, ins, ident)
            elif isinstance(step, P2P):
                for msg in step.msgs:
                    if msg.kind == "send":
                        self.exchange.send(self.rank, msg, ins,
                                           shape=msg.region.local_shape)
                for msg in step.msgs:
                    if msg.kind == "recv":
                        yield Wait(self.rank, msg, ins, shape=msg.region.local_shape)


def _communication(programs: Sequence[Program]) -> dict[tuple[str, int], Any]:
    """Walk the programs' communication (3 of the module docstring); the weight regions they
    take (``_Abstract.held``)."""
    exchange = Exchange()
    held: dict[tuple[str, int], Any] = {}
    run_all({p.rank: walk(p, _Abstract(p.rank, exchange, held)) for p in programs}, exchange)
    return held
