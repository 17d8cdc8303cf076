"""Static checks of a pipeline schedule: every unit exactly once, on its device, after its data.

Rules, in the order they run (later rules assume the earlier ones passed):

1. every unit names an existing stage, micro-batch and pass (``UnknownUnit``; a backward of a
   forward-only stage is ``BackwardOfForwardOnly``) and sits on the device that hosts its stage
   (``MisplacedUnit``);
2. no unit appears twice (``DuplicateUnit``) and none is missing (``MissingUnit``); a unit of a
   shared stage (``StageGraph.hosts``: the interlaced pipeline's embedding and head) appears
   once on each of its devices;
3. on one device, no unit comes before a unit it depends on (``OrderAgainstData``; the most common
   case, a backward before its own forward, is ``ForwardAfterBackward``); two devices that both
   run units of shared stages run those they have in common in the same order
   (``SharedOrderMismatch``: they meet in each, as in a collective);
4. once every cross-device dependency is a send matched with its receive, no set of devices waits
   for each other (``Deadlock``, in ``ssdsl.check.deadlock``).

Each error carries the span of the order statement(s) that placed the units involved; independent
errors of one rule are reported together (``ErrorGroup``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ssdsl.errors import ErrorCollector, SsdslError
from ssdsl.schedule.deps import data_deps
from ssdsl.schedule.units import Pass, Program, Schedule, Unit
from ssdsl.source import Span

_PASS_NAME = {Pass.F: "forward", Pass.B: "backward", Pass.I: "input-gradient",
              Pass.W: "weight-gradient"}


class ScheduleError(SsdslError):
    """A schedule that cannot run. ``spans`` are the statements involved, the one to blame first
    (``span``); the others are listed in the hint so a user sees both ends of a conflict."""

    def __init__(self, message: str, spans: Iterable[Span | None] = (), *,
                 hint: str | None = None) -> None:
        self.spans = tuple(dict.fromkeys(s for s in spans if s is not None))
        others = ", ".join(f"line {s.line}:{s.column}" for s in self.spans[1:])
        if others:
            hint = f"{hint}; see also {others}" if hint else f"see also {others}"
        super().__init__(message, self.spans[0] if self.spans else None, hint=hint)


class UnknownUnit(ScheduleError):
    """A unit names a stage, micro-batch or pass the schedule does not have."""


class MisplacedUnit(ScheduleError):
    """A unit is ordered on a device that does not host its stage."""


class DuplicateUnit(ScheduleError):
    """A unit is ordered twice: it would run its micro-batch twice."""


class MissingUnit(ScheduleError):
    """Some micro-batches of a stage have no unit for a pass: their gradients would be lost."""


class BackwardOfForwardOnly(UnknownUnit):
    """A backward unit of a stage that has none: the loss differentiates nothing it computes."""


class SharedOrderMismatch(ScheduleError):
    """Two devices run the units of a shared stage that both run in different orders."""


class OrderAgainstData(ScheduleError):
    """A unit is ordered before a unit on the same device whose result it needs."""


class ForwardAfterBackward(OrderAgainstData):
    """A backward is ordered before the forward of the same stage and micro-batch."""


def describe(unit: Unit) -> str:
    """``'backward of stage 1, micro-batch 3 (1B3)'``."""
    return f"{_PASS_NAME[unit.kind]} of stage {unit.stage}, micro-batch {unit.mb} ({unit})"


def _mbs(mbs: list[int]) -> str:
    """Micro-batch numbers as short ranges: ``0..2, 5`` (ranges are inclusive here)."""
    parts: list[str] = []
    start = prev = mbs[0]
    for m in mbs[1:] + [None]:  # type: ignore[list-item]
        if m is not None and m == prev + 1:
            prev = m
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if m is not None:
            start = prev = m
    return ", ".join(parts)


def _check_unit_known(schedule: Schedule, prog: Program, k: int) -> None:
    unit, span = prog.units[k], prog.spans[k]
    g = schedule.stages
    if not 0 <= unit.stage < g.num_stages:
        raise UnknownUnit(f"unit {unit} names stage {unit.stage}, but the plan has stages "
                          f"0..{g.num_stages - 1}", [span])
    if not 0 <= unit.mb < schedule.microbatches:
        raise UnknownUnit(f"unit {unit} names micro-batch {unit.mb}, but there are micro-batches "
                          f"0..{schedule.microbatches - 1}", [span])
    if unit.kind is not Pass.F and not g.has_backward(unit.stage):
        raise BackwardOfForwardOnly(
            f"{describe(unit)}: stage {unit.stage} has no backward, since the loss "
            "differentiates nothing it computes (its outputs reach the loss only through a "
            ".detach(), as in the first passes of a recycling model)", [span],
            hint=f"order only forwards of stage {unit.stage}")
    if unit.kind not in schedule.passes():
        names = ", ".join(p.value for p in schedule.passes())
        raise UnknownUnit(f"unit {unit} runs pass {unit.kind.value}, but this schedule's passes "
                          f"are {names}", [span],
                          hint="split backwards (I and W) and whole ones (B) cannot be mixed")
    if not g.runs(unit.stage, prog.device):
        hosts = g.hosts[unit.stage]
        where = f"device {hosts[0]}" if len(hosts) == 1 else \
            f"devices {', '.join(map(str, hosts))}"
        raise MisplacedUnit(f"{describe(unit)} is ordered on device {prog.device}, but stage "
                            f"{unit.stage} is assigned to {where}", [span],
                            hint=f"order it on {where}, or assign the stage here")


def _check_known(schedule: Schedule) -> None:
    errors = ErrorCollector()
    for prog in schedule.programs:
        for k in range(len(prog)):
            with errors.catch():
                _check_unit_known(schedule, prog, k)
    errors.raise_if_any()


def _first_spans(schedule: Schedule) -> dict[Unit, Span | None]:
    # Rule 1 put every unit on a device of its stage, so a unit in two programs is a unit of a
    # shared stage (once on each of its devices); twice in one program is a duplicate.
    seen: dict[Unit, Span | None] = {}
    errors = ErrorCollector()
    for prog in schedule.programs:
        here: dict[Unit, Span | None] = {}
        for unit, span in zip(prog.units, prog.spans):
            if unit in here:
                errors.add(DuplicateUnit(
                    f"{describe(unit)} is ordered twice on device {prog.device}",
                    [span, here[unit]], hint="each micro-batch runs each pass of a stage once"))
            else:
                here[unit] = span
                seen.setdefault(unit, span)
    errors.raise_if_any()
    return seen


def _stage_span(schedule: Schedule, seen: dict[Unit, Span | None], stage: int) -> Span | None:
    # A missing unit has no statement of its own: blame the statement that ordered the stage's
    # other units, else any order statement of its device.
    spans = [s for u, s in seen.items() if u.stage == stage and s is not None]
    if spans:
        return min(spans)
    prog = schedule.programs[schedule.stages.devices[stage]]
    return min((s for s in prog.spans if s is not None), default=None)


def _missing_text(kind: Pass, mbs: list[int]) -> str:
    word = "micro-batch" if len(mbs) == 1 else "micro-batches"
    return f"no {_PASS_NAME[kind]} for {word} {_mbs(mbs)}"


def _check_complete(schedule: Schedule, seen: dict[Unit, Span | None]) -> None:
    errors = ErrorCollector()
    g = schedule.stages
    shared = any(g.shared(s) for s in range(g.num_stages))
    on = [set(p.units) for p in schedule.programs] if shared else []
    for s in range(g.num_stages):
        for d in g.hosts[s]:
            has = on[d] if shared else seen
            missing = [(kind, [m for m in range(schedule.microbatches)
                               if Unit(s, kind, m) not in has])
                       for kind in schedule.passes(s)]
            parts = [_missing_text(kind, mbs) for kind, mbs in missing if mbs]
            if parts:
                errors.add(MissingUnit(
                    f"stage {s} (device {d}) has {' and '.join(parts)}",
                    [_stage_span(schedule, seen, s)],
                    hint=f"order every micro-batch ({_mbs(list(range(schedule.microbatches)))}) "
                         "of every stage" + (" on each of its devices" if g.shared(s) else "")))
    errors.raise_if_any()


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _check_shared_order(schedule: Schedule) -> None:
    """Devices that both run units of shared stages run the units they share in one order."""
    g = schedule.stages
    if not any(g.shared(s) for s in range(g.num_stages)):
        return
    errors = ErrorCollector()
    progs = schedule.programs
    for p in progs:
        for q in progs[p.device + 1:]:
            common = [s for s in range(g.num_stages) if g.runs(s, p.device) and g.runs(s, q.device)]
            if not common:
                continue
            both = set(common)
            mine = [(u, sp) for u, sp in zip(p.units, p.spans) if u.stage in both]
            theirs = [(u, sp) for u, sp in zip(q.units, q.spans) if u.stage in both]
            at = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a[0] != b[0]), None)
            if at is None:
                continue
            (a, sa), (b, sb) = mine[at], theirs[at]
            errors.add(SharedOrderMismatch(
                f"devices {p.device} and {q.device} run the units of stage"
                f"{'s' if len(common) > 1 else ''} {', '.join(map(str, common))} in different "
                f"orders: the {_nth(at + 1)} of them is {a} on device {p.device} but {b} on "
                f"device {q.device}", [sa, sb],
                hint="the devices of a shared stage meet in each of its units (its collectives): "
                     "order them alike on every device, e.g. from one loop"))
    errors.raise_if_any()


def _order_violations(schedule: Schedule, prog: Program) -> Iterator[ScheduleError]:
    pos = {u: k for k, u in enumerate(prog.units)}
    for k, unit in enumerate(prog.units):
        for dep in data_deps(unit, schedule.stages, split_backward=schedule.split_backward):
            j = pos.get(dep)
            if j is None or j < k:
                continue  # on another device (a message), or correctly earlier
            cls = (ForwardAfterBackward if dep.kind is Pass.F and dep.stage == unit.stage
                   else OrderAgainstData)
            yield cls(f"{describe(unit)} is ordered at step {k} on device {prog.device}, before "
                      f"{describe(dep)} at step {j}, whose result it needs",
                      [prog.spans[k], prog.spans[j]],
                      hint=f"move {unit} after {dep}")


def _check_order(schedule: Schedule) -> None:
    errors = ErrorCollector()
    for prog in schedule.programs:
        for err in _order_violations(schedule, prog):
            errors.add(err)
    errors.raise_if_any()


def check_structure(schedule: Schedule) -> None:
    """Rules 1 to 3: raise the first rule's errors (all of them) when any unit breaks it."""
    if len(schedule.programs) < schedule.stages.num_devices:
        raise MisplacedUnit(f"stages are assigned to {schedule.stages.num_devices} devices but "
                            f"only {len(schedule.programs)} programs were given")
    _check_known(schedule)
    seen = _first_spans(schedule)
    _check_complete(schedule, seen)
    _check_order(schedule)
    _check_shared_order(schedule)
