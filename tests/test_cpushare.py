"""CPU shares of pipeline ranks on a crowded host (``ssdsl.runtime.cpushare``).

Oracles: the schedule's event simulation (``ssdsl.schedule.simulate``) where every rank has its
cores; the total work on one core (a shared core never idles while a unit can run, so no
assignment of shares changes the step); a reference written here, which steps time in fixed
ticks over 1F1B's unit lists built by hand; and the kernel's own view of a process's priority
(``os.getpriority``, ``/proc/self/autogroup``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ssdsl.runtime import cpushare
from ssdsl.schedule.builders import gpipe, interleaved_1f1b, one_f_one_b, three_f_one_b, zb_h1
from ssdsl.schedule.simulate import Costs, simulate
from ssdsl.schedule.units import Pass

SCHEDULES = {
    "gpipe": gpipe(4, 6),
    "1f1b": one_f_one_b(4, 6),
    "interleaved": interleaved_1f1b(2, 4, 2),
    "zb_h1": zb_h1(3, 5),
    "3f1b": three_f_one_b(2, 4, 2),
}


def _seconds(unit, rank: int) -> float:
    """Uneven but simple unit times: stages differ, a backward twice a forward."""
    base = 1.0 + 0.25 * unit.stage
    return {Pass.F: base, Pass.B: 2 * base, Pass.I: base, Pass.W: base}[unit.kind]


def _costs(schedule) -> Costs:
    n = schedule.stages.num_stages
    fwd = tuple(1.0 + 0.25 * s for s in range(n))
    return Costs(forward=fwd, backward=tuple(2 * f for f in fwd), input_grad=fwd,
                 weight_grad=fwd)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_own_cores_is_the_event_simulation(name):
    schedule = SCHEDULES[name]
    n = len(schedule.programs)
    places = [{r: 1} for r in range(n)]  # a host each
    got = cpushare.shared_step(schedule, _seconds, places, {r: 1.0 for r in range(n)},
                               [1.0] * n)
    assert got == pytest.approx(simulate(schedule, _costs(schedule)).makespan, rel=1e-9)
    # one host with a core per rank: the same, whatever the weights
    got = cpushare.shared_step(schedule, _seconds, [{0: 1}] * n, {0: float(n)},
                               [cpushare.weight(3 * (r % 3)) for r in range(n)])
    assert got == pytest.approx(simulate(schedule, _costs(schedule)).makespan, rel=1e-9)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_one_core_takes_the_total_work_whatever_the_shares(name):
    schedule = SCHEDULES[name]
    n = len(schedule.programs)
    # a shared stage's unit is work on each of its ranks (they run it together)
    total = sum(_seconds(unit, r) for r, prog in enumerate(schedule.programs)
                for unit in prog.units)
    shared = any(schedule.stages.shared(s) for s in range(schedule.stages.num_stages))
    for weights in ([1.0] * n, [cpushare.weight(6 * (r % 2)) for r in range(n)]):
        got = cpushare.shared_step(schedule, _seconds, [{0: 1}] * n, {0: 1.0}, weights)
        if shared:  # its ranks wait for each other: the core may idle meanwhile
            assert got >= total - 1e-9
        else:
            assert got == pytest.approx(total, rel=1e-9)
    assert cpushare.choose(schedule, _seconds, [{0: 1}] * n, {0: 1.0}) is None


def _reference_1f1b(p: int, m: int, f, b, weights, cores: int, tick: float = 1e-3) -> float:
    """1F1B on ``p`` one-thread ranks sharing ``cores`` cores, in ticks of ``tick``: each tick
    the runnable ranks take the cores in proportion to ``weights``, at most one each."""
    progs = []
    for s in range(p):
        warm = min(p - s - 1, m)
        seq = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", i) for i in range(m - warm, m)]
        progs.append(seq)
    pos, left, done, t = [0] * p, [None] * p, set(), 0
    while any(pos[s] < len(progs[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if pos[s] == len(progs[s]):
                continue
            kind, i = progs[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" and s > 0 else \
                ("B", s + 1, i) if kind == "B" and s < p - 1 else None
            if dep is None or dep in done:
                ready.append(s)
                if left[s] is None:
                    left[s] = (f if kind == "F" else b)(s)
        give, cap = {}, float(cores)
        todo = list(ready)
        while todo:  # the share of each, at most a core
            total = sum(weights[s] for s in todo)
            full = [s for s in todo if cap * weights[s] / total >= 1]
            if not full:
                give.update({s: cap * weights[s] / total for s in todo})
                break
            for s in full:
                give[s], cap = 1.0, cap - 1
                todo.remove(s)
        t += 1
        for s in ready:
            left[s] -= give[s] * tick
            if left[s] <= 1e-9:
                kind, i = progs[s][pos[s]]
                done.add((kind, s, i))
                pos[s], left[s] = pos[s] + 1, None
    return t * tick


def test_crowded_1f1b_against_a_reference_in_ticks():
    schedule = one_f_one_b(4, 4)

    def seconds(unit, rank):  # the last stage holds the head and the loss
        scale = 1.25 if unit.stage == 3 else 1.0
        return (0.42 if unit.kind is Pass.F else 0.79) * scale

    places = [{0: 1}] * 4
    for levels in [(0, 0, 0, 0), (6, 6, 3, 0), (0, 3, 6, 6), (3, 0, 0, 3)]:
        weights = [cpushare.weight(v) for v in levels]
        got = cpushare.shared_step(schedule, seconds, places, {0: 2.0}, weights)
        want = _reference_1f1b(4, 4, lambda s: 0.42 * (1.25 if s == 3 else 1),
                               lambda s: 0.79 * (1.25 if s == 3 else 1), weights, 2)
        assert got == pytest.approx(want, abs=5e-3), levels


def test_crowded_1f1b_favours_the_later_stages():
    """Four stages on two cores: the choice beats even shares by more than the margin, in the
    reference's time too, and never lowers the last stage below an earlier one."""
    schedule = one_f_one_b(4, 4)

    def seconds(unit, rank):
        return 0.42 if unit.kind is Pass.F else 0.79

    got = cpushare.choose(schedule, seconds, [{0: 1}] * 4, {0: 2.0})
    assert got is not None
    levels, fast, even = got
    assert levels[3] == 0 and levels[0] > 0
    assert list(levels) == sorted(levels, reverse=True)
    weights = [cpushare.weight(v) for v in levels]
    want_fast = _reference_1f1b(4, 4, lambda s: 0.42, lambda s: 0.79, weights, 2)
    want_even = _reference_1f1b(4, 4, lambda s: 0.42, lambda s: 0.79, [1.0] * 4, 2)
    assert want_fast < want_even * (1 - cpushare.MARGIN)
    assert (fast, even) == (pytest.approx(want_fast, abs=5e-3), pytest.approx(want_even, abs=5e-3))


def test_no_choice_without_crowding():
    schedule = one_f_one_b(4, 4)
    assert cpushare.choose(schedule, _seconds, [{0: 1}] * 4, {0: 4.0}) is None
    # two threads a rank fill four cores with two ranks already
    assert cpushare.choose(schedule, _seconds, [{0: 1}] * 4, {0: 4.0}, threads=2) is not None


def test_weights_are_the_kernels_nice_ratios():
    assert cpushare.weight(0) == 1.0
    # each nice step is about 1.25 times less CPU (the kernel's table)
    for v in range(1, 19):
        assert cpushare.weight(v - 1) / cpushare.weight(v) == pytest.approx(1.25, rel=0.03)


_CHILD = textwrap.dedent("""
    import os, sys
    from ssdsl.runtime import cpushare
    before = (os.getpriority(os.PRIO_PROCESS, 0), cpushare.autogroup_nice())
    took = cpushare.lower_priority(int(sys.argv[1]))
    print(took, *before, os.getpriority(os.PRIO_PROCESS, 0), cpushare.autogroup_nice())
""")


def _child(steps: int, session: bool) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(steps)], capture_output=True,
                         text=True, check=True, start_new_session=session, timeout=60)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's scheduler")
def test_lower_priority_as_the_kernel_sees_it():
    mine = cpushare.autogroup_nice()
    took, nice0, group0, nice1, group1 = _child(3, session=True)
    assert took == "True" and int(nice1) == int(nice0) + 3
    autogroups = cpushare.autogroup_nice() is not None and open(
        "/proc/sys/kernel/sched_autogroup_enabled").read().strip() == "1"
    if autogroups:  # a session of its own: its autogroup lowered too
        assert int(group1) == int(group0) + 3
    # a process that does not lead its session leaves the session's autogroup alone
    took, nice0, group0, nice1, group1 = _child(3, session=False)
    assert took == "True" and int(nice1) == int(nice0) + 3 and group1 == group0
    assert cpushare.autogroup_nice() == mine  # this process's session untouched


def test_settle_leaves_a_rank_alone_when_turned_off_or_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(cpushare, "lower_priority", lambda steps: calls.append(steps) or True)
    monkeypatch.setattr(cpushare, "_level", lambda m, rank: 3)
    for env, device, want in [("even", "cpu", None), ("", "cuda", None), ("", "cpu", 3)]:
        monkeypatch.setenv(cpushare.ENV_VAR, env)
        monkeypatch.setattr(cpushare, "_DONE", {})
        assert cpushare.settle(None, 0, device) == want
        assert cpushare.settle(None, 0, device) == want  # once per process
    assert calls == [3]
