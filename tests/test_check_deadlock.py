"""Deadlock and order checks against an independent oracle: under asynchronous sends a schedule
can run exactly when program order plus data dependencies form an acyclic graph."""

from __future__ import annotations

import random

import pytest

from ssdsl.check import (CommModel, Deadlock, OrderAgainstData, check_deadlock, check_schedule,
                         check_structure)
from ssdsl.errors import ErrorGroup
from ssdsl.schedule.builders import gpipe, interleaved_1f1b, one_f_one_b
from ssdsl.schedule.deps import data_deps
from ssdsl.schedule.units import Program, Schedule, StageGraph


def _has_cycle(schedule: Schedule) -> bool:
    """Oracle: depth-first search for a cycle in program-order edges plus data edges."""
    succ: dict = {u: [] for p in schedule.programs for u in p.units}
    for p in schedule.programs:
        for a, b in zip(p.units, p.units[1:]):
            succ[a].append(b)
    for u in succ:
        for d in data_deps(u, schedule.stages, split_backward=schedule.split_backward):
            succ[d].append(u)
    state: dict = {}

    def visit(u) -> bool:
        state[u] = 1
        for v in succ[u]:
            if state.get(v) == 1 or (v not in state and visit(v)):
                return True
        state[u] = 2
        return False

    return any(u not in state and visit(u) for u in list(succ))


def _random_schedule(rng: random.Random) -> Schedule:
    n = rng.randint(2, 5)
    edges = [(s, s + 1) for s in range(n - 1)]
    edges += [(a, b) for a in range(n) for b in range(a + 2, n) if rng.random() < 0.3]
    ndev = rng.randint(1, n)
    devices = [s % ndev for s in range(n)]
    g = StageGraph(devices, edges)
    base = gpipe(ndev, rng.randint(1, 3), stages=g)
    progs = []
    for prog in base.programs:
        units = list(prog.units)
        # Swap a few neighbours: small perturbations of a valid schedule hit both outcomes often.
        for _ in range(rng.randint(0, 4)):
            if len(units) > 1:
                i = rng.randrange(len(units) - 1)
                units[i], units[i + 1] = units[i + 1], units[i]
        progs.append(Program.of(prog.device, units))
    return Schedule(g, base.microbatches, progs)


@pytest.mark.parametrize("seed", range(200))
def test_async_verdict_matches_cycle_oracle(seed):
    schedule = _random_schedule(random.Random(seed))
    try:
        check_schedule(schedule)
        ok = True
    except (OrderAgainstData, Deadlock):
        ok = False
    except ErrorGroup as group:
        assert all(isinstance(e, OrderAgainstData) for e in group.errors)
        ok = False
    assert ok == (not _has_cycle(schedule))


def test_oracle_sees_both_outcomes():
    verdicts = {_has_cycle(_random_schedule(random.Random(s))) for s in range(200)}
    assert verdicts == {True, False}


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 7), (8, 8)])
def test_standard_schedules_pass_async(p, m):
    for s in (gpipe(p, m), one_f_one_b(p, m)):
        check_schedule(s)
    if m % p == 0:
        check_schedule(interleaved_1f1b(p, m, 2))


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 3)])
def test_gpipe_passes_but_1f1b_deadlocks_with_blocking_sends(p, m):
    check_deadlock(gpipe(p, m), comm=CommModel.RENDEZVOUS)
    with pytest.raises(Deadlock) as info:
        check_deadlock(one_f_one_b(p, m), comm=CommModel.RENDEZVOUS)
    assert ">]" in info.value.render()  # a device stuck while sending


def test_single_microbatch_1f1b_has_no_crossing_sends():
    # With one micro-batch there is no steady state, so blocking sends cannot cross.
    check_deadlock(one_f_one_b(4, 1), comm=CommModel.RENDEZVOUS)


def test_deadlock_grid_is_cut_to_a_window_for_long_programs():
    s = one_f_one_b(2, 40)
    units = [str(u) for u in s.programs[1].units]
    # Device 1 takes micro-batch 22 early, before 1B20; device 0 sends 0F22 only after 0B20,
    # which needs 1B20: a two-device cycle deep inside long programs.
    units.remove("1F22")
    units.insert(units.index("1F20") + 1, "1F22")
    bad = Schedule(s.stages, s.microbatches, [s.programs[0], Program.parse(1, " ".join(units))])
    check_structure(bad)  # locally fine; the fault is across devices
    with pytest.raises(Deadlock) as info:
        check_deadlock(bad)
    text = info.value.render()
    assert "[1F22]" in text and "[0B20]" in text and "(steps 38..45 of 80)" in text
    assert max(len(line) for line in text.splitlines()) < 200
