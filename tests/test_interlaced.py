"""The interlaced pipeline (issue 11, SuperScaler's T5 / large-vocabulary plan): stage groups that
overlap lower to per-device programs, a stage on several devices' classes is *shared* (each of
them runs all its units), and ``stdlib_plans/interlaced_1f1b.ssp`` puts the embedding and the
head on all devices, tensor-parallel, around a 1F1B pipeline of the blocks.

Oracles: the single-device model (``run_reference`` in the gloo runs; the plain model simulated
against all ranks' programs in one process before launch), the data dependencies of the stage
chain written out by hand (which unit needs which), and the instruction-level checker of the
lowered programs, which never reads the schedule checker's verdict.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import attrs
import pytest
import torch

from ssdsl.check import (Deadlock, MissingUnit, SharedOrderMismatch, check_programs,
                         check_schedule)
from ssdsl.cli import main
from tests.checked_run import assert_gloo_run_matches
from ssdsl.elaborate import elaborate_file, elaborate_text
from ssdsl.errors import ErrorGroup, SsdslError
from ssdsl.lower import lower_plan
from ssdsl.lower.walk import ProgramError
from ssdsl.materialize.program import materialize
from ssdsl.parse.format import format_text
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from ssdsl.schedule.lower import lower_schedule
from ssdsl.schedule.resolve import TooManyStages, resolve_pipeline
from ssdsl.schedule.simulate import simulate
from ssdsl.schedule.units import Pass, Program, Schedule, StageGraph, Unit
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
BIG = ROOT / "examples" / "gpt_bigvocab.py"


def _lowered(world: int, **sets: object):
    plan = elaborate_file("interlaced_1f1b", world=world,
                          sets={k: str(v) for k, v in sets.items()})
    return lower_schedule(plan.directives)


@cache
def _graph(model: Path = GPT):
    return trace(load_model_file(str(model)), device="meta")


@pytest.mark.parametrize("p, m", [(p, m) for p in range(2, 9) for m in sorted({1, p, 2 * p})])
def test_each_device_runs_the_shared_stages_and_its_own(p, m):
    low = _lowered(p, microbatches=m)
    check_schedule(low.schedule)
    g = low.schedule.stages
    last = p + 1
    assert low.groups == tuple((d,) for d in range(p))      # a rank per device
    assert g.hosts[0] == g.hosts[last] == tuple(range(p))   # embedding and head: everywhere
    for d, prog in enumerate(low.schedule.programs):
        stages = {u.stage for u in prog.units}
        assert stages == {0, d + 1, last}
        assert len(prog.units) == len(set(prog.units)) == 3 * 2 * m
    # the shared units come in one order on every device
    orders = {tuple(u for u in prog.units if u.stage in (0, last))
              for prog in low.schedule.programs}
    assert len(orders) == 1


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16)])
def test_shared_units_are_interlaced_where_the_stages_need_them(p, m):
    """On every device each own forward after the embedding's forward of its micro-batch and
    each own backward after the head's backward of it (the stage chain's dependencies); the
    embedding's backward of i after the first stage's backward of i. And the shared units are
    placed by time, not just before the first unit that needs them: the head of micro-batch k
    runs on device 0 before device 0's backward of k - 1 (in 1F1B, with F = 1 and B = 2, the
    last stage finishes k's forward at about p + 3k, device 0 starts k - 1's backward at about
    3p + 3k - 5: earlier from p = 3 on), so the head never waits for a gradient to come back through every stage."""
    low = _lowered(p, microbatches=m)
    last = p + 1
    for d, prog in enumerate(low.schedule.programs):
        at = {u: k for k, u in enumerate(prog.units)}
        for i in range(m):
            assert at[Unit(0, Pass.F, i)] < at[Unit(d + 1, Pass.F, i)]
            assert at[Unit(last, Pass.F, i)] < at[Unit(last, Pass.B, i)] \
                < at[Unit(d + 1, Pass.B, i)]
            if d == 0:
                assert at[Unit(1, Pass.B, i)] < at[Unit(0, Pass.B, i)]
                if i >= 1 and p >= 3:
                    assert at[Unit(last, Pass.F, i)] < at[Unit(1, Pass.B, i - 1)]
    # the blocks keep 1F1B's order on each device: at most p - d forwards alive
    for d, prog in enumerate(low.schedule.programs):
        own = [u for u in prog.units if u.stage == d + 1]
        alive = peak = 0
        for u in own:
            alive += 1 if u.kind is Pass.F else -1
            peak = max(peak, alive)
        assert peak == min(p - d, m)


def test_plans_without_overlap_lower_as_before():
    # equal or disjoint groups are their own classes: 1f1b on 4 devices is rank == device
    plan = elaborate_file("1f1b", world=4)
    low = lower_schedule(plan.directives)
    assert low.groups == ((0,), (1,), (2,), (3,))
    assert low.schedule.stages.hosts == ((0,), (1,), (2,), (3,))
    assert "hosts" not in repr(low.schedule)  # the plan digest hashes this repr
    plan = elaborate_file("dp_tp_1f1b", world=8, sets={"dp": "2", "tp": "2", "pp": "2"})
    assert lower_schedule(plan.directives).groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_a_lag_too_short_is_refused_at_the_plan_statements():
    with pytest.raises(SsdslError) as err:
        check_schedule(_lowered(4, microbatches=8, lag=1).schedule)
    errors = err.value.errors if isinstance(err.value, ErrorGroup) else [err.value]
    assert all(e.span is not None and e.span.file.endswith("interlaced_1f1b.ssp")
               for e in errors)


def test_a_shared_unit_is_a_meeting_point_for_the_deadlock_check():
    # device 0 runs the shared stage 0 and then 1F0, which device 1's 2F0 needs; device 1 runs
    # 2F0 first: each waits for the other (as sends and receives alone they would not)
    g = StageGraph([0, 0, 1], [(1, 2)], forward_only=[0, 1, 2], hosts=[(0, 1), (0,), (1,)])
    with pytest.raises(Deadlock) as err:
        check_schedule(Schedule.parse(g, 1, "0: 0F0 1F0\n1: 2F0 0F0"))
    assert "waits at 0F0, a unit of a shared stage, for device 1" in err.value.details
    check_schedule(Schedule.parse(g, 1, "0: 0F0 1F0\n1: 0F0 2F0"))


def _misordered(s):
    """``s`` with device 1's forward of the shared stage 0 for micro-batch 2 moved to right
    after its micro-batch 1: device 0 still runs them in the other order."""
    units, spans = list(s.programs[1].units), list(s.programs[1].spans)
    k = units.index(Unit(0, Pass.F, 2))
    u, sp = units.pop(k), spans.pop(k)
    j = units.index(Unit(0, Pass.F, 1)) + 1
    units.insert(j, u)
    spans.insert(j, sp)
    return attrs.evolve(s, programs=[s.programs[0], Program(1, units, spans)])


def test_devices_that_order_a_shared_stage_differently_are_refused():
    bad = _misordered(_lowered(2, microbatches=4).schedule)
    with pytest.raises(SharedOrderMismatch, match="0F2 on device 1"):
        check_schedule(bad)


def test_the_program_checker_sees_the_shared_collectives_independently():
    """The same misordering, lowered to instructions without the schedule check: the
    embedding's all-gathers are in each device's program, and the ranks would deadlock."""
    t, low = resolve_pipeline(transform(_graph(), elaborate_file("interlaced_1f1b", world=2)))
    bad = attrs.evolve(low, schedule=_misordered(low.schedule))
    good = materialize(t, dtype=torch.float32, schedule=low)
    check_programs(lower_plan(good).programs, m=good)
    m = materialize(t, dtype=torch.float32, schedule=bad)
    with pytest.raises(ProgramError, match="deadlock"):
        check_programs(lower_plan(m).programs, m=m)


def test_a_device_missing_a_shared_unit_is_named():
    g = StageGraph([0, 0, 1, 0], [(0, 1), (1, 2), (2, 3)],
                   hosts=[(0, 1), (0,), (1,), (0, 1)])
    full = Schedule.parse(g, 1, "0: 0F0 1F0 3F0 3B0 1B0 0B0\n1: 0F0 2F0 3F0 3B0 2B0 0B0")
    check_schedule(full)
    short = Schedule.parse(g, 1, "0: 0F0 1F0 3F0 3B0 1B0 0B0\n1: 0F0 2F0 3F0 3B0 2B0")
    with pytest.raises(MissingUnit, match=r"stage 0 \(device 1\) has no backward"):
        check_schedule(short)


def test_a_shared_unit_starts_together_on_all_its_devices():
    # device 1 reaches the head (stage 3) late: device 0 waits for it there
    g = StageGraph([0, 0, 1, 0], [(0, 1), (1, 2), (2, 3)],
                   hosts=[(0, 1), (0,), (1,), (0, 1)])
    r = simulate(Schedule.parse(g, 1, "0: 0F0 1F0 3F0 3B0 1B0 0B0\n1: 0F0 2F0 3F0 3B0 2B0 0B0"))
    start = {(e.device, str(e.unit)): e.start for evs in r.events for e in evs}
    # F = 1, B = 2: 0F0 [0, 1], 1F0 [1, 2], 2F0 [2, 3] on device 1, so 3F0 starts at 3 on both
    assert start[(0, "3F0")] == start[(1, "3F0")] == 3.0
    # then 3B0 [4, 6], 2B0 [6, 8] on device 1, 1B0 [8, 10] on device 0: 0B0 at 10 on both
    assert start[(0, "0B0")] == start[(1, "0B0")] == 10.0


def test_stages_into_inside_a_selector_list():
    text = "plan p()\nstages wte, h.* into 2, ln_f as st\nassign all to device 0\n"
    assert format_text(text.replace(", ", " ,  ")).splitlines()[1] == \
        "stages wte, h.* into 2, ln_f as st"
    plan = elaborate_text(text, world=1)
    (st,) = [d for d in plan.directives if getattr(d, "kind", "") == "stages"]
    assert (st.count, st.splits) == (4, (1, 2, 1))
    from ssdsl.schedule.resolve import stage_map
    t = transform(_graph(), plan)
    stage_of = stage_map(t, st)
    mods = {op.name: op.module for op in t.graph.ops}
    assert {s for n, s in stage_of.items() if mods[n].startswith("h.0")} == {1}
    assert {s for n, s in stage_of.items() if mods[n].startswith("h.1")} == {2}
    assert {s for n, s in stage_of.items() if mods[n] in ("ln_f", "lm_head")} == {3}


def test_stages_into_more_than_the_operators_is_located():
    plan = elaborate_text("plan p()\nstages wte into 9, h.* as st\nassign all to device 0\n",
                          world=1)
    (st,) = [d for d in plan.directives if getattr(d, "kind", "") == "stages"]
    from ssdsl.schedule.resolve import stage_map
    with pytest.raises(TooManyStages, match="only") as err:
        stage_map(transform(_graph(), plan), st)
    assert (err.value.span.line, err.value.span.column) == (2, 1)


@pytest.mark.parametrize("model", [GPT, BIG])
def test_two_ranks_verified_against_the_plain_model(model):
    v = verify_before_launch(JobSpec(str(model), "interlaced_1f1b", ()), 2)
    assert v.verified and v.dtype == "float64"
    assert abs(v.loss - v.reference_loss) < 1e-12 and v.max_grad_error < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_run_matches_the_reference(capsys, world):
    assert_gloo_run_matches(capsys, BIG, "interlaced_1f1b", world)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_the_cost_simulator_agrees_with_the_schedule_simulator(p, m):
    """Two simulators written apart (``ssdsl.cost`` over ranks with per-device unit costs, and
    ``ssdsl.schedule.simulate``): with F = 1 and B = 2 everywhere they give the interlaced
    schedule one makespan, and each shared unit starts at one time on all its ranks."""
    from ssdsl.cost import Cluster, CostOptions, simulate_costs
    from ssdsl.cost.work import PlanCosts, StaticMemory, UnitCost
    from tests.test_cost import FLAT
    s = _lowered(p, microbatches=m).schedule
    g = s.stages
    units = {(d, st): UnitCost(fwd_compute=1.0, bwd_compute=2.0)
             for st in range(g.num_stages) for d in g.hosts[st]}
    zero = {d: 0.0 for d in range(p)}
    costs = PlanCosts(units, {}, {}, zero, zero, {d: StaticMemory(0, 0, 0) for d in range(p)},
                      tuple(range(p)))
    r = simulate_costs(costs, s, tuple((d,) for d in range(p)), CostOptions(
        profile=FLAT, cluster=Cluster(p, 8)))
    assert r.makespan == pytest.approx(simulate(s).makespan)
    starts: dict[Unit, set[float]] = {}
    for iv in r.intervals:
        starts.setdefault(iv.unit, set()).add(iv.start)
    assert all(len(v) == 1 for v in starts.values())
    assert {iv.rank for iv in r.intervals if iv.unit == Unit(0, Pass.F, 0)} == set(range(p))


def test_show_and_cost_take_the_interlaced_plan(capsys):
    assert main(["show", str(GPT), "interlaced_1f1b", "--world", "4", "--no-picture",
                 "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["ranks"] == [[0], [1], [2], [3]]
    assert main(["cost", str(BIG), "interlaced_1f1b", "--world", "4", "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)
    assert cost["ranks"] == [[0], [1], [2], [3]] and cost["step_time_s"] > 0


def test_groups_that_overlap_in_part_run_like_the_plain_model(tmp_path):
    """Not only the interlaced layout: stage 0 on devices 0, 1 and stage 1 on devices 1, 2
    (each batch-split in two) make three classes, device 1 running both stages' parts."""
    plan = tmp_path / "partial.ssp"
    plan.write_text("plan partial(microbatches: int = 2)\n"
                    "microbatch along batch into microbatches\n"
                    "stages wte, h.* as st\n"
                    "partition all along batch into 2\n"
                    "assign st[0] to devices 0..2\n"
                    "assign st[1] to devices 1..3\n")
    low = lower_schedule(elaborate_file(str(plan), world=3).directives)
    assert low.groups == ((0,), (1,), (2,))
    assert low.schedule.stages.hosts == ((0, 1), (1, 2))
    v = verify_before_launch(JobSpec(str(GPT), str(plan), ()), 3)
    assert v.verified and abs(v.loss - v.reference_loss) < 1e-12 and v.max_grad_error < 1e-10
