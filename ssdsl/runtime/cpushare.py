"""CPU shares of pipeline ranks that share a host's cores, chosen from their schedule.

Where a host runs more ranks than its cores hold (four one-thread ranks on two cores), the
kernel shares the cores out evenly among whichever ranks can run. A pipeline's ranks are not
alike, though. In 1F1B's warm-up stage 0 runs forwards that a later stage needs only a few
units on, while the backward a later stage is running is what every stage before it waits for:
even shares slow the urgent work down to speed up work that can wait. On the peers' 1F1B (four
stages of two blocks, four micro-batches, bench/bench_peers.py) on two cores, the cost model
below puts one step at 120.7 ms with even shares and at 111.3 ms with shares rising toward the
last stage (weights 1 : 1 : 2 : 4).

``settle(m, rank, device)``, once per process, in a rank of a running job on the CPU whose
host's ranks outnumber its cores (``ssdsl.runtime.host.own_cores``):

- simulates one step of every pipeline rank's units, in program order, each host's cores shared
  among its runnable ranks in proportion to their weights (a rank of ``t`` compute threads uses
  at most ``t`` cores; a shared stage's unit runs on all its ranks at the pace of the slowest),
  with the units' times from the cost model of this machine (``ssdsl.cost``, the CPU profile);
- for each assignment of a level in ``LEVELS`` to each pipeline rank (every assignment up to
  ``EXHAUSTIVE`` of them, else a coordinate search from even shares), keeps the fastest, and
  only where it beats even shares by more than ``MARGIN`` of the step (the model's own error);
- lowers this rank's priority by its level's nice steps. The kernel only lets a process lower
  its own priority, so the most urgent ranks keep theirs (level 0). A rank that leads a session
  of its own (``ssdsl run``'s launcher starts each rank so) is an autogroup of its own where
  the kernel groups sessions (``/proc/sys/kernel/sched_autogroup_enabled``), and autogroups
  share the cores by the autogroup's nice value, so that is set too; under ``torchrun`` the
  ranks share a session and the process's own nice value is what counts.

Every rank of a host computes the same choice from the same programs: nothing is exchanged.
Which rank runs first never changes what a step computes, only when. GPU ranks, ranks with
cores of their own and plans without a pipeline are left alone. ``SSDSL_CPU_SHARES=even`` in
the environment, or ``ENABLED = False``, leaves every rank at its priority (benchmarks
compare).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ssdsl.schedule.deps import data_deps
from ssdsl.schedule.units import Schedule, Unit

log = logging.getLogger(__name__)

# False: every rank keeps its priority (benchmarks compare; see the module docstring)
ENABLED = True
ENV_VAR = "SSDSL_CPU_SHARES"
# the nice steps a rank may lower itself by
LEVELS = (0, 3, 6)
# the least share of the step the best assignment must save over even shares
MARGIN = 0.03
# assignments tried one by one up to this many (3 levels: 6 pipeline ranks), else a search
EXHAUSTIVE = 729

# The kernel's CPU weight of each nice value (``sched_prio_to_weight``, nice 0 to 19): a
# runnable task's share of a core against the others is its weight over theirs.
_NICE_WEIGHT = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45, 36,
                29, 23, 18, 15)

_DONE: dict[int, int | None] = {}  # process id -> the level settle() chose there


def weight(level: int) -> float:
    """The CPU weight of a rank lowered by ``level`` nice steps, relative to one not lowered."""
    return _NICE_WEIGHT[min(max(level, 0), len(_NICE_WEIGHT) - 1)] / _NICE_WEIGHT[0]


def shared_step(schedule: Schedule, seconds: Callable[[Unit, int], float],
                places: Sequence[Mapping[int, int]], cores: Mapping[int, float],
                weights: Sequence[float], threads: int = 1) -> float:
    """The time one step of ``schedule`` takes when its pipeline ranks share cores.

    ``seconds(unit, r)``: the unit's time on pipeline rank ``r`` with its cores to itself;
    ``places[r]``: host -> how many processes of ``r`` run there (a pipeline rank of several
    devices runs them in lockstep); ``cores[host]``: that host's cores; ``weights[r]``: the CPU
    weight of each of ``r``'s processes; ``threads``: the cores one process can use. A runnable
    process gets its weight's share of its host's cores, at most ``threads`` (the rest going to
    the others); a unit advances at the pace of its slowest process. ``inf`` when the programs
    cannot finish (a deadlock: the checker says where)."""
    programs = [p.units for p in schedule.programs]
    stages = schedule.stages
    split = schedule.split_backward
    pc = [0] * len(programs)
    left: dict[Unit, float] = {}
    done: set[Unit] = set()
    now = 0.0
    while True:
        running: dict[Unit, tuple[int, ...]] = {}
        for r, units in enumerate(programs):
            if pc[r] == len(units):
                continue
            unit = units[pc[r]]
            if unit in running:
                continue
            ranks = stages.hosts[unit.stage] if stages.shared(unit.stage) else (r,)
            if any(pc[h] == len(programs[h]) or programs[h][pc[h]] != unit for h in ranks):
                continue  # a shared stage's unit starts when all its ranks reach it
            if all(dep in done for dep in data_deps(unit, stages, split_backward=split)):
                running[unit] = ranks
                if unit not in left:
                    left[unit] = max(seconds(unit, h) for h in ranks)
        if not running:
            return now if all(pc[r] == len(p) for r, p in enumerate(programs)) else float("inf")
        pace = _paces(running, places, cores, weights, threads)
        dt = min(left[u] / pace[u] for u in running)
        now += dt
        for unit, ranks in running.items():
            left[unit] -= dt * pace[unit]
            if left[unit] <= 1e-12:
                done.add(unit)
                for h in ranks:
                    pc[h] += 1


def _paces(running: Mapping[Unit, tuple[int, ...]], places: Sequence[Mapping[int, int]],
           cores: Mapping[int, float], weights: Sequence[float], threads: int
           ) -> dict[Unit, float]:
    """Each running unit's pace (1: its processes each have ``threads`` cores)."""
    on_host: dict[int, list[int]] = {}
    for ranks in running.values():
        for r in ranks:
            for host in places[r]:
                on_host.setdefault(host, []).append(r)
    share: dict[tuple[int, int], float] = {}  # (host, rank) -> cores one process of it gets
    for host, ranks in on_host.items():
        capacity = float(cores.get(host, threads))
        todo = list(ranks)
        while todo:
            total = sum(weights[r] * places[r][host] for r in todo)
            full = [r for r in todo if capacity * weights[r] / total >= threads]
            if not full:
                for r in todo:
                    share[(host, r)] = capacity * weights[r] / total
                break
            for r in full:
                share[(host, r)] = float(threads)
                capacity -= threads * places[r][host]
                todo.remove(r)
    return {unit: min(min(share[(host, r)] for host in places[r]) / threads for r in ranks)
            for unit, ranks in running.items()}


def choose(schedule: Schedule, seconds: Callable[[Unit, int], float],
           places: Sequence[Mapping[int, int]], cores: Mapping[int, float], threads: int = 1
           ) -> tuple[tuple[int, ...], float, float] | None:
    """``(level of each pipeline rank, simulated step, the step with even shares)`` for the
    fastest assignment of ``LEVELS``, or None where none beats even shares by ``MARGIN``."""
    n = len(schedule.programs)
    if n < 2 or not _crowded(places, cores, threads):
        return None

    def step(levels: Sequence[int]) -> float:
        return shared_step(schedule, seconds, places, cores, [weight(v) for v in levels],
                           threads)

    even_levels = (0,) * n
    even = step(even_levels)
    best, best_time = even_levels, even
    if len(LEVELS) ** n <= EXHAUSTIVE:
        for levels in itertools.product(LEVELS, repeat=n):
            if min(levels) != 0:
                continue  # the same shares as the assignment one level lower everywhere
            t = step(levels)
            if t < best_time:
                best, best_time = levels, t
    else:  # one rank's level at a time, twice round, from even shares
        for _ in range(2):
            for r in range(n):
                for v in LEVELS:
                    levels = best[:r] + (v,) + best[r + 1:]
                    t = step(levels) if levels != best and min(levels) == 0 else best_time
                    if t < best_time:
                        best, best_time = levels, t
    if best_time >= even * (1 - MARGIN):
        return None
    return best, best_time, even


def _crowded(places: Sequence[Mapping[int, int]], cores: Mapping[int, float],
             threads: int) -> bool:
    """Whether some host's processes need more cores than it has."""
    need: dict[int, int] = {}
    for where in places:
        for host, k in where.items():
            need[host] = need.get(host, 0) + k * threads
    return any(k > cores.get(host, k) for host, k in need.items())


def settle(m: Any, rank: int, device: Any = "cpu") -> int | None:
    """Lower this rank's priority as its pipeline's schedule wants on a crowded host (see the
    module docstring), once per process; the level it chose (None: left alone)."""
    pid = os.getpid()
    if pid in _DONE:
        return _DONE[pid]
    level = None
    if ENABLED and os.environ.get(ENV_VAR, "").strip().lower() != "even" \
            and getattr(device, "type", device) == "cpu":
        try:
            level = _level(m, rank)
        except Exception as err:  # noqa: BLE001 - a priority is a hint: training goes on
            log.debug("ssdsl: CPU shares not chosen: %s", err)
            level = None
        if level:
            level = level if lower_priority(level) else None
    _DONE.clear()  # a forked child starts with its parent's table
    _DONE[pid] = level
    return level


def _level(m: Any, rank: int) -> int | None:
    import torch
    import torch.distributed as dist

    from ssdsl.runtime.host import local_ranks, own_cores, usable_cpus
    if m.schedule is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    if own_cores():
        return None
    from ssdsl.cost import Cluster, CostOptions, profile
    from ssdsl.cost.simulate import unit_seconds
    from ssdsl.cost.work import plan_costs
    schedule = m.schedule.schedule
    groups = tuple(tuple(g) for g in m.schedule.groups)
    world = dist.get_world_size()
    local = local_ranks()
    threads = max(1, torch.get_num_threads())
    opts = CostOptions(profile=profile("cpu"), cluster=Cluster(world, local), optimizer="sgd")
    seconds = unit_seconds(plan_costs(m, opts), schedule, groups)
    places = [_count(d // local for d in g) for g in groups]
    hosts = {h for where in places for h in where}
    got = choose(schedule, seconds, places, {h: float(usable_cpus()) for h in hosts}, threads)
    if got is None:
        return None
    levels, fast, even = got
    mine = next((r for r, g in enumerate(groups) if rank in g), None)
    if mine is None:
        return None
    log.debug("ssdsl: CPU levels %s: a step of %.1f ms against %.1f ms with even shares",
              levels, fast * 1e3, even * 1e3)
    return levels[mine]


def _count(items: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def lower_priority(steps: int) -> bool:
    """Lower this process's CPU priority by ``steps`` nice steps: its own nice value, and its
    autogroup's where it leads its session and the kernel groups sessions. Whether it took."""
    took = False
    try:
        os.nice(steps)
        took = True
    except OSError:
        pass
    if _leads_autogroup():
        try:
            current = autogroup_nice()
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(min(19, (current or 0) + steps)))
            took = True
        except OSError:
            pass
    return took


def _leads_autogroup() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            enabled = f.read().strip() == "1"
    except OSError:
        return False
    return enabled and hasattr(os, "getsid") and os.getsid(0) == os.getpid()


def autogroup_nice() -> int | None:
    """The nice value of this process's autogroup (``/proc/self/autogroup``), None where the
    kernel has none."""
    try:
        with open("/proc/self/autogroup") as f:
            text = f.read().split()
    except OSError:
        return None
    try:
        return int(text[text.index("nice") + 1])
    except (ValueError, IndexError):
        return None
