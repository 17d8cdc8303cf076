"""Time and memory of one training step: every rank's units in schedule order, with communication.

Each pipeline rank (the devices of one stage group, which run the same program in lockstep)
runs its units in program order. A unit starts when the rank is free and every unit it depends on
has finished, plus the time that unit's tensors take to reach it (a forward's activations from the
stage before, a backward's gradient from the stage after: send/recv); it lasts as long as its
slowest device needs for its parts and the collectives inside the stage. Sends are asynchronous
(as the runtime's ``isend``), so only the receiver waits. A plan without stages is one rank of
all devices running ``F(0, k) B(0, k)`` per micro-batch. After the last unit the runtime sums the
weight gradients (bucketed all-reduces, not overlapped), steps the optimizer and all-reduces the
loss; the step time is the sum.

Figures: ``bubble`` = the share of the pipeline's device time spent waiting,
``1 - busy / (ranks x makespan)``; with uniform stages, F = 1, B = 2 and no communication, 1F1B and
GPipe give ``(p - 1) / (m + p - 1)``. Memory per device over time: the static bytes (parameters,
gradients, optimizer state) plus the activations of every forward not yet consumed by its
backward, plus, while a backward runs, what it recomputes.
"""

from __future__ import annotations

from typing import Any

import attrs

from ssdsl.cost.work import (CostOptions, PlanCosts, StaticMemory, UnitCost, loss_reduce_time,
                             plan_costs)
from ssdsl.materialize.program import Materialized
from ssdsl.schedule.deps import data_deps
from ssdsl.schedule.simulate import UnitWalk
from ssdsl.schedule.units import Pass, Program, Schedule, StageGraph, Unit

_HALF = {Pass.I: 0.5, Pass.W: 0.5}


@attrs.frozen
class Interval:
    """One unit on one pipeline rank from ``start`` to ``end`` (seconds)."""

    unit: Unit
    rank: int
    start: float
    end: float


@attrs.frozen
class DeviceReport:
    """The figures of one device."""

    device: int
    compute: float        # seconds of operator work in the step
    communication: float  # seconds in collectives and receives (stage adapters, reducer, loss)
    static: StaticMemory
    peak_activations: float
    peak_memory: float
    memory_timeline: tuple[tuple[float, float], ...]  # (time, bytes) after each change
    flops: float


@attrs.frozen
class CostReport:
    """The simulated step (see the module doc)."""

    step_time: float
    makespan: float          # the pipeline part (forward and backward units)
    bubble: float
    reducer_time: float
    optimizer_time: float
    devices: tuple[DeviceReport, ...]
    intervals: tuple[Interval, ...]
    schedule: Schedule
    groups: tuple[tuple[int, ...], ...]
    options: CostOptions

    @property
    def communication(self) -> float:
        return max((d.communication for d in self.devices), default=0.0)

    @property
    def peak_memory(self) -> float:
        return max((d.peak_memory for d in self.devices), default=0.0)

    def to_json(self) -> dict[str, Any]:
        o = self.options
        return {
            "device": o.profile.name, "world": o.cluster.world, "per_node": o.cluster.per_node,
            "dtype": o.dtype, "optimizer": o.optimizer,
            "step_time_s": self.step_time, "pipeline_s": self.makespan, "bubble": self.bubble,
            "reducer_s": self.reducer_time, "optimizer_s": self.optimizer_time,
            "communication_s": self.communication, "peak_memory_bytes": self.peak_memory,
            "memory_capacity_bytes": o.profile.memory,
            "ranks": [list(g) for g in self.groups],
            "programs": [str(p) for p in self.schedule.programs],
            "devices": [{"device": d.device, "compute_s": d.compute,
                         "communication_s": d.communication, "flops": d.flops,
                         "params_bytes": d.static.params, "grads_bytes": d.static.grads,
                         "optimizer_bytes": d.static.optimizer,
                         "peak_activation_bytes": d.peak_activations,
                         "peak_memory_bytes": d.peak_memory} for d in self.devices],
        }


def _pipeline(m: Materialized) -> tuple[Schedule, tuple[tuple[int, ...], ...]]:
    lowered = m.schedule
    if lowered is not None:
        return lowered.schedule, tuple(tuple(g) for g in lowered.groups)
    n = m.transformed.microbatches
    units = [u for k in range(n) for u in (Unit(0, Pass.F, k), Unit(0, Pass.B, k))]
    schedule = Schedule(StageGraph.chain([0]), n, [Program.of(0, units)])
    return schedule, (tuple(m.transformed.devices()),)


def estimate(m: Materialized, opts: CostOptions) -> CostReport:
    """Simulate one training step of ``m`` on ``opts``' devices."""
    schedule, groups = _pipeline(m)
    return simulate_costs(plan_costs(m, opts), schedule, groups, opts)


def simulate_costs(costs: PlanCosts, schedule: Schedule, groups: tuple[tuple[int, ...], ...],
                   opts: CostOptions) -> CostReport:
    """The step of ``schedule`` (over ranks; rank r is ``groups[r]``) under ``costs``."""
    sim = _Sim(costs, schedule, groups)
    intervals = sim.intervals()
    makespan = max((iv.end for iv in intervals), default=0.0)
    busy = sum(iv.end - iv.start for iv in intervals)
    ranks = len(groups)
    bubble = 1 - busy / (ranks * makespan) if makespan else 0.0
    devices = tuple(d for g in groups for d in g)
    # each device reduces its gradients after its own last backward (some parts during it):
    # the step's reducer time is what the last of them adds beyond the pipeline
    finish = max((_reduced_at(costs, intervals, r, d, opts.profile.comm_overlap)
                  for r, g in enumerate(groups) for d in g), default=0.0)
    reducer = max(finish - makespan, 0.0)
    optimizer = max((costs.optimizer.get(d, 0.0) for d in devices), default=0.0)
    loss = loss_reduce_time(opts, devices) if costs.loss_collective and len(devices) > 1 else 0.0
    step = makespan + reducer + optimizer + loss
    reports = tuple(_device_report(costs, schedule, groups, intervals, d, makespan, loss)
                    for d in sorted(devices))
    return CostReport(step, makespan, bubble, reducer, optimizer, reports, tuple(intervals),
                      schedule, groups, opts)


def _reduced_at(costs: PlanCosts, intervals: list[Interval], rank: int, d: int,
                hidden: float) -> float:
    """When device ``d`` (on pipeline rank ``rank``) has reduced every gradient bucket. The
    parts overlapped with its last backward (``PlanCosts.overlapped``) start, one after another,
    once their gradients are final; the share ``hidden`` of the time they run beside that
    backward is hidden by it (``DeviceProfile.comm_overlap``), the rest is added; the other
    buckets follow."""
    last = max((iv for iv in intervals if iv.rank == rank and iv.unit.kind is not Pass.F),
               key=lambda iv: iv.end, default=None)
    start, end = (last.start, last.end) if last is not None else (0.0, 0.0)
    t, beside = start, 0.0
    for ready, seconds in costs.overlapped.get(d, ()):
        begin = max(start + ready * (end - start), t)
        t = begin + seconds
        beside += max(0.0, min(t, end) - begin)
    return max(t, end) + (1 - hidden) * beside + costs.reducer.get(d, 0.0)


def _walks(costs: PlanCosts, d: int, unit: Unit) -> float:
    """How many backwards' work ``unit`` does on device ``d``: an input half and a whole one
    where the programs walk it in two (``PlanCosts.sent_first``), what a split unit does where
    a weight half waits for a later one (``PlanCosts.backward_work``), else 1."""
    if unit.kind is Pass.B:
        key = (d, unit.stage, unit.mb)
        if key in costs.sent_first:
            return 1 + _HALF[Pass.I]
        return costs.backward_work.get(key, 1.0)
    return 1.0


class _Sim(UnitWalk):
    """Mutable state of one simulation (lives only inside ``simulate_costs``)."""

    def __init__(self, costs: PlanCosts, schedule: Schedule, groups) -> None:
        super().__init__(schedule, len(groups))
        self.costs, self.groups = costs, groups
        self.out: list[Interval] = []
        # a backward walked in two (``PlanCosts.sent_first``): when its gradients leave
        self.sent_at: dict[Unit, float] = {}

    def unit_cost(self, d: int, stage: int) -> UnitCost:
        return self.costs.units.get((d, stage), UnitCost())

    def rank_duration(self, unit: Unit, rank: int) -> float:
        times = []
        for d in self.groups[rank]:
            c = self.unit_cost(d, unit.stage)
            times.append(c.forward if unit.kind is Pass.F else c.backward * _HALF.get(unit.kind, 1))
        return max(times, default=0.0) * _walks(self.costs, self.groups[rank][0], unit)

    def duration(self, unit: Unit, hosts: tuple[int, ...]) -> float:
        return max(self.rank_duration(unit, h) for h in hosts)

    def record(self, unit: Unit, r: int, start: float, end: float) -> None:
        d = self.groups[r][0]
        walks = _walks(self.costs, d, unit)
        if walks != 1.0 or (unit.kind is Pass.B and (d, unit.stage, unit.mb)
                            in self.costs.split_first):
            # the gradients leave after the first walk or half, an input half
            self.sent_at[unit] = start + (end - start) * _HALF[Pass.I] / walks
        self.out.append(Interval(unit, r, start, end))

    def delay(self, dep: Unit, unit: Unit, rank: int) -> float:
        """Time ``dep``'s tensors take to reach ``unit`` (on ``rank``)."""
        if dep.stage == unit.stage:
            return 0.0
        if unit.kind is Pass.F:  # activations dep.stage -> unit.stage, received by rank
            key = lambda d: (dep.stage, unit.stage, d)  # noqa: E731
            return max((self.costs.fwd_delay.get(key(d), 0.0) for d in self.groups[rank]),
                       default=0.0)
        key = lambda d: (unit.stage, dep.stage, d)  # noqa: E731  gradient back to unit.stage
        return max((self.costs.bwd_delay.get(key(d), 0.0) for d in self.groups[rank]),
                   default=0.0)

    def ready(self, unit: Unit, r: int) -> float | Unit:
        start = self.free[r]
        for dep in data_deps(unit, self.schedule.stages,
                             split_backward=self.schedule.split_backward):
            done = self.end.get(dep)
            if done is None:
                return dep
            if dep.stage != unit.stage:  # a backward walked in two sent them after its first
                done = self.sent_at.get(dep, done)
            start = max(start, done + self.delay(dep, unit, r))
        return start

    def intervals(self) -> list[Interval]:
        if not self.run():
            raise ValueError("the schedule deadlocks; `ssdsl check` says where")
        return sorted(self.out, key=lambda iv: (iv.start, iv.rank))


def _device_report(costs: PlanCosts, schedule: Schedule, groups, intervals, d: int,
                   makespan: float, loss: float) -> DeviceReport:
    rank = next(r for r, g in enumerate(groups) if d in g)
    static = costs.memory.get(d, StaticMemory(0.0, 0.0, 0.0))
    compute = flops = 0.0
    comm = costs.reducer.get(d, 0.0) + sum(t for _, t in costs.overlapped.get(d, ())) + loss
    live = peak_act = 0.0
    waiting = 0.0  # activations of input halves whose weight halves run in a later unit
    timeline = [(0.0, static.total)]
    for iv in (iv for iv in intervals if iv.rank == rank):
        c = costs.units.get((d, iv.unit.stage), UnitCost())
        share = _HALF.get(iv.unit.kind, 1.0)
        if iv.unit.kind is Pass.F:
            compute += c.fwd_compute
            comm += c.fwd_comm + _received(costs.fwd_delay, iv.unit.stage, d, schedule, fwd=True)
            live += c.activations
            peak_act = max(peak_act, live)
            timeline.append((iv.end, static.total + live))
            continue
        compute += (c.bwd_compute + c.recompute) * share * _walks(costs, d, iv.unit)
        comm += c.bwd_comm * share
        if iv.unit.kind is not Pass.W:
            comm += _received(costs.bwd_delay, iv.unit.stage, d, schedule, fwd=False)
        peak_act = max(peak_act, live + c.recompute_peak)
        timeline.append((iv.start, static.total + live + c.recompute_peak))
        if iv.unit.kind is not Pass.I:
            work = costs.backward_work.get((d, iv.unit.stage, iv.unit.mb), 1.0) \
                if iv.unit.kind is Pass.B else 1.0
            if work < 1.0:  # its weight half waits for a later unit (``DEFER_W``): so does
                waiting += c.activations  # what it reads (counted whole: an upper bound)
            else:
                live -= c.activations
                if work > 1.0:  # the unit that runs the waiting weight halves frees theirs
                    live, waiting = live - waiting, 0.0
        timeline.append((iv.end, static.total + live))
    for (dev, _s), c in costs.units.items():
        if dev == d:
            flops += c.flops * schedule.microbatches
    timeline.append((makespan, static.total))
    # ZeRO-3's gathered buckets are counted at the activations' peak (an upper bound)
    return DeviceReport(d, compute, comm, static, peak_act,
                        static.total + static.gathered + peak_act, tuple(timeline), flops)


def _received(delays, stage: int, d: int, schedule: Schedule, *, fwd: bool) -> float:
    """Seconds device d spends receiving for one unit of ``stage``."""
    g = schedule.stages
    if fwd:
        return sum(delays.get((a, stage, d), 0.0) for a in g.preds(stage))
    return sum(delays.get((stage, b, d), 0.0) for b in g.succs(stage))
