"""The simulator against the analytic pipeline figures and against an independent relaxation."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from ssdsl.check import check_structure
from ssdsl.schedule.builders import gpipe, interleaved_1f1b, one_f_one_b
from ssdsl.schedule.deps import data_deps
from ssdsl.schedule.simulate import Costs, peak_live, simulate
from ssdsl.schedule.units import Pass, Program, Schedule, StageGraph

SIZES = [(4, 8), (2, 4), (3, 6), (4, 4), (8, 16), (5, 3)]


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_bubble_and_memory(p, m):
    r = simulate(gpipe(p, m))
    assert r.bubble_overhead == pytest.approx((p - 1) / m)
    assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert r.makespan == pytest.approx((m + p - 1) * 3.0)  # F = 1, B = 2
    assert r.peak_activations == (m,) * p


@pytest.mark.parametrize("p,m", SIZES)
def test_one_f_one_b_bubble_and_memory(p, m):
    r = simulate(one_f_one_b(p, m))
    assert r.bubble_overhead == pytest.approx((p - 1) / m)
    assert r.peak_activations == tuple(min(p - d, m) for d in range(p))


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 2), (4, 8, 4), (3, 9, 3), (2, 2, 2)])
def test_interleaved_bubble(p, m, v):
    # A chunk holds 1/v of a device's layers: costs scale so the ideal time equals plain 1F1B's.
    r = simulate(interleaved_1f1b(p, m, v), Costs(forward=1 / v))
    assert r.bubble_overhead == pytest.approx((p - 1) / (v * m))
    assert sum(r.busy) == pytest.approx(p * m * 3.0)


def test_done_criterion_p4_m8():
    """The issue's figures: bubble (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved; peak
    activations m for GPipe and p on device 0 for 1F1B."""
    assert simulate(gpipe(4, 8)).bubble_overhead == pytest.approx(3 / 8)
    assert simulate(one_f_one_b(4, 8)).bubble_overhead == pytest.approx(3 / 8)
    assert simulate(interleaved_1f1b(4, 8, 2)).bubble_overhead == pytest.approx(3 / 16)
    assert simulate(gpipe(4, 8)).peak_activations[0] == 8
    assert simulate(one_f_one_b(4, 8)).peak_activations[0] == 4


def test_latency_adds_per_hop():
    # p = 2, m = 1: F0, hop, F1, B1, hop, B0 -> 1 + L + 1 + 2 + L + 2.
    r = simulate(gpipe(2, 1), Costs(latency=0.5))
    assert r.makespan == pytest.approx(7.0)


def test_skip_edge_waits_for_both_successors():
    g = StageGraph([0, 1, 2], [(0, 1), (1, 2), (0, 2)])
    r = simulate(gpipe(3, 1, stages=g))
    starts = {str(e.unit): e.start for evs in r.events for e in evs}
    assert starts == {"0F0": 0, "1F0": 1, "2F0": 2, "2B0": 3, "1B0": 5, "0B0": 7}
    assert r.makespan == 9


def test_per_stage_costs_slowest_stage_dominates():
    # GPipe with a slow middle stage: the steady state runs at its pace.
    r = simulate(gpipe(3, 4), Costs(forward=(1, 3, 1)))
    # Forwards: stage 1 finishes its 4 forwards at 1 + 4*3; stage 2 ends its last F one later;
    # then backwards (2, 6, 2 each) mirror it.
    f_end = 1 + 4 * 3 + 1
    assert r.makespan == pytest.approx(f_end + 2 + 4 * 6 + 2)


def test_split_backward_costs_and_memory():
    prog = Program.parse(0, "0F0 0F1 0I0 0W0 0I1 0W1")
    s = Schedule(StageGraph.chain([0]), 2, [prog], split_backward=True)
    r = simulate(s, Costs(forward=1, input_grad=2, weight_grad=3))
    assert r.makespan == 2 * (1 + 2 + 3)
    assert peak_live(prog) == 2


def _relaxed_starts(schedule: Schedule, costs: Costs) -> dict:
    """Oracle: start times as the fixed point of start = max(prev end, dep end + latency),
    computed by repeated sweeps in no particular order (Bellman-Ford style)."""
    host = schedule.stages.devices
    start = {u: 0.0 for p in schedule.programs for u in p.units}
    prev = {}
    for p in schedule.programs:
        for a, b in zip(p.units, p.units[1:]):
            prev[b] = a
    order = list(start)
    random.Random(0).shuffle(order)
    changed = True
    while changed:
        changed = False
        for u in order:
            t = 0.0
            if u in prev:
                t = start[prev[u]] + costs.of(prev[u])
            for d in data_deps(u, schedule.stages, split_backward=schedule.split_backward):
                lat = costs.latency if host[d.stage] != host[u.stage] else 0.0
                t = max(t, start[d] + costs.of(d) + lat)
            if t != start[u]:
                start[u], changed = t, True
    return start


@pytest.mark.parametrize("seed", range(12))
def test_simulation_matches_relaxation_oracle(seed):
    rng = random.Random(seed)
    p, m = rng.randint(2, 4), rng.randint(1, 6)
    edges = [(s, s + 1) for s in range(p - 1)] + [(0, p - 1)] * rng.randint(0, 1)
    g = StageGraph(range(p), edges)
    base = rng.choice([gpipe(p, m, stages=g), one_f_one_b(p, m) if len(edges) == p - 1 else
                       gpipe(p, m, stages=g)])
    costs = Costs(forward=tuple(rng.choice([1, 2, 0.5]) for _ in range(p)),
                  latency=rng.choice([0.0, 0.25]))
    check_structure(base)
    r = simulate(base, costs)
    oracle = _relaxed_starts(base, costs)
    for evs in r.events:
        for e in evs:
            assert e.start == pytest.approx(oracle[e.unit])
            assert e.end - e.start == pytest.approx(costs.of(e.unit))


def test_bubble_matches_exact_fraction_for_1f1b():
    r = simulate(one_f_one_b(4, 8))
    assert Fraction(r.idle).limit_denominator() / Fraction(sum(r.busy)) == Fraction(3, 8)
    assert all(e.unit.kind in (Pass.F, Pass.B) for evs in r.events for e in evs)
