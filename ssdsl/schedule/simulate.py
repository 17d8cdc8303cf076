"""Event simulation of a schedule: when each unit runs, how long devices idle, how much they hold.

Every device runs its program in order; a unit starts when the device is free and every unit it
depends on has finished (plus ``Costs.latency`` when that unit ran on another device, the time a
message takes). Sends are asynchronous, as in the runtime, so a device never waits to send.

Figures, for ``p`` devices and makespan ``T``:

- ``bubble_ratio`` = idle / total = 1 - busy / (p T), the share of device time spent waiting;
- ``bubble_overhead`` = idle / busy, the figure the Megatron-LM papers quote: (p - 1) / m for GPipe
  and 1F1B, (p - 1) / (v m) for interleaved 1F1B with v chunks per device;
- ``peak_activations[d]``: the most micro-batches whose activations device d holds at once (a
  forward adds one, the backward that consumes them, ``B`` or ``W``, frees it). On a device with
  several stages each stage's micro-batch counts once.

Example::

    >>> from ssdsl.schedule.builders import gpipe
    >>> r = simulate(gpipe(4, 8))
    >>> (r.makespan, r.bubble_overhead, r.peak_activations)
    (33.0, 0.375, (8, 8, 8, 8))
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from ssdsl.schedule.deps import data_deps
from ssdsl.schedule.units import Pass, Program, Schedule, StageGraph, Unit

PerStage = float | tuple[float, ...]


def _per_stage(value: PerStage, stage: int) -> float:
    return float(value[stage]) if isinstance(value, tuple) else float(value)


def _tuple_or_float(value: PerStage | None) -> PerStage | None:
    return tuple(value) if isinstance(value, (list, tuple)) else value


@attrs.frozen(kw_only=True)
class Costs:
    """Duration of each pass, one number for all stages or a tuple indexed by stage.

    ``backward`` defaults to twice ``forward`` (a backward computes two products per forward one);
    ``input_grad`` and ``weight_grad`` (a split backward) default to ``forward`` each.
    ``latency`` is the time a message takes between devices.
    """

    forward: PerStage = attrs.field(default=1.0, converter=_tuple_or_float)
    backward: PerStage | None = attrs.field(default=None, converter=_tuple_or_float)
    input_grad: PerStage | None = attrs.field(default=None, converter=_tuple_or_float)
    weight_grad: PerStage | None = attrs.field(default=None, converter=_tuple_or_float)
    latency: float = 0.0

    def of(self, unit: Unit) -> float:
        """The duration of ``unit``."""
        fwd = _per_stage(self.forward, unit.stage)
        if unit.kind is Pass.F:
            return fwd
        explicit = {Pass.B: self.backward, Pass.I: self.input_grad,
                    Pass.W: self.weight_grad}[unit.kind]
        if explicit is not None:
            return _per_stage(explicit, unit.stage)
        return 2.0 * fwd if unit.kind is Pass.B else fwd


@attrs.frozen
class Event:
    """One unit run on one device from ``start`` to ``end``."""

    unit: Unit
    device: int
    start: float
    end: float


@attrs.frozen
class SimResult:
    """The simulated timeline of a schedule and its figures (see the module docstring)."""

    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]  # per device, in program order
    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]

    @property
    def num_devices(self) -> int:
        return len(self.events)

    @property
    def idle(self) -> float:
        return self.num_devices * self.makespan - sum(self.busy)

    @property
    def bubble_ratio(self) -> float:
        total = self.num_devices * self.makespan
        return self.idle / total if total else 0.0

    @property
    def bubble_overhead(self) -> float:
        busy = sum(self.busy)
        return self.idle / busy if busy else 0.0


def peak_live(program: Program, stages: StageGraph | None = None) -> int:
    """The most forwards whose activations are held at once while ``program`` runs in order
    (a forward of a ``forward_only`` stage keeps none)."""
    live = peak = 0
    for unit in program.units:
        if unit.kind is Pass.F and stages is not None and not stages.has_backward(unit.stage):
            continue
        if unit.kind is Pass.F:
            live += 1
            peak = max(peak, live)
        elif unit.kind in (Pass.B, Pass.W):
            live -= 1
    return peak


class UnitWalk:
    """Run every device's program in order, each unit as soon as it may start: the walk both
    simulators share (this module's, in abstract time units, and ``ssdsl.cost.simulate``'s, in
    seconds). Subclasses say when a unit may start on a device (``ready``), how long it takes on
    the devices that run it (``duration``) and what to record of it (``record``).

    A unit of a shared stage (the interlaced pipeline's embedding and head) runs on all its
    devices at once, when the last of them is ready: they meet in its collectives."""

    def __init__(self, schedule: Schedule, ranks: int) -> None:
        self.schedule = schedule
        self.end: dict[Unit, float] = {}
        self.free = [0.0] * ranks
        self.pcs = [0] * ranks
        self.waiting: dict[object, list[int]] = defaultdict(list)
        self.arrived: dict[Unit, set[int]] = defaultdict(set)

    def ready(self, unit: Unit, r: int) -> float | Unit:
        """When ``unit`` may start on ``r``, or the first unit it still waits for."""
        raise NotImplementedError

    def duration(self, unit: Unit, hosts: tuple[int, ...]) -> float:
        raise NotImplementedError

    def record(self, unit: Unit, r: int, start: float, end: float) -> None:
        raise NotImplementedError

    def advance(self, r: int) -> list[int]:
        """Run ``r`` until it waits; return the devices its finished units wake."""
        prog, woken = self.schedule.programs[r].units, []
        g = self.schedule.stages
        while self.pcs[r] < len(prog):
            unit = prog[self.pcs[r]]
            hosts = g.hosts[unit.stage] if g.shared(unit.stage) else (r,)
            if len(hosts) > 1:
                here = self.arrived[unit]
                here.add(r)
                if len(here) < len(hosts):
                    self.waiting[(unit, "meet")].append(r)
                    break
            starts = [self.ready(unit, h) for h in hosts]
            blocked = next((s for s in starts if isinstance(s, Unit)), None)
            if blocked is not None:
                self.waiting[blocked].append(r)
                break
            start = max(starts)
            end = start + self.duration(unit, hosts)
            for h in hosts:
                self.record(unit, h, start, end)
                self.free[h] = end
                self.pcs[h] += 1
            self.end[unit] = end
            woken += self.waiting.pop(unit, []) + self.waiting.pop((unit, "meet"), [])
        return woken

    def run(self) -> bool:
        """Walk to the end; False when some program could not finish (a deadlock)."""
        todo = list(range(len(self.free)))
        while todo:
            todo += self.advance(todo.pop())
        return all(pc == len(p) for pc, p in zip(self.pcs, self.schedule.programs))


class _Sim(UnitWalk):
    """Mutable state of one simulation (lives only inside ``simulate``)."""

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        super().__init__(schedule, schedule.num_devices)
        self.costs = costs
        self.events: list[list[Event]] = [[] for _ in schedule.programs]

    def ready(self, unit: Unit, r: int) -> float | Unit:
        t = self.free[r]
        g = self.schedule.stages
        for dep in data_deps(unit, g, split_backward=self.schedule.split_backward):
            done = self.end.get(dep)
            if done is None:
                return dep
            lat = self.costs.latency if not g.runs(dep.stage, r) else 0.0
            t = max(t, done + lat)
        return t

    def duration(self, unit: Unit, hosts: tuple[int, ...]) -> float:
        return self.costs.of(unit)

    def record(self, unit: Unit, r: int, start: float, end: float) -> None:
        self.events[r].append(Event(unit, r, start, end))


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Simulate ``schedule`` (which must pass ``ssdsl.check.check_structure``) under ``costs``.

    Raises ``ValueError`` when the programs deadlock; ``ssdsl.check.check_deadlock`` says where.
    """
    sim = _Sim(schedule, costs or Costs())
    if not sim.run():
        raise ValueError("the schedule deadlocks; run ssdsl.check.check_schedule for the cycle")
    events = tuple(tuple(evs) for evs in sim.events)
    makespan = max((evs[-1].end for evs in events if evs), default=0.0)
    busy = tuple(sum(e.end - e.start for e in evs) for evs in events)
    peaks = tuple(peak_live(p, schedule.stages) for p in schedule.programs)
    return SimResult(schedule, events, makespan, busy, peaks)
