"""ZB-H1 and ZB-V: the stdlib plans, their simulated bubbles against the analytic figures, and
the checkers refusing a split backward written wrong, at the plan line.

Oracles: ``ssdsl.schedule.builders.zb_h1`` (a construction in Python that does not read the
plan), torch.distributed.pipelining's own ZB-V order (``ScheduleZBVZeroBubble``), 1F1B's
analytic bubble ratio (p - 1) / (m + p - 1), and ZB-H1's (the paper's (p - 1)(F + I - W) of idle
per device, over a makespan of m (F + I + W) plus that idle).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from ssdsl.check import (BadUnitStructure, MissingUnit, OrderAgainstData, ProgramError,
                         check_programs, check_schedule)
from ssdsl.elaborate import elaborate_file, elaborate_text
from ssdsl.errors import ErrorGroup
from ssdsl.lower import lower_plan, parse_program, program_text
from ssdsl.materialize.program import materialize
from ssdsl.resources import stdlib_dir
from ssdsl.runtime.job import SplitBackwardWithRecompute, schedule_plan
from ssdsl.schedule.builders import one_f_one_b, zb_h1
from ssdsl.schedule.lower import lower_schedule
from ssdsl.schedule.simulate import Costs, simulate
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"


def _stdlib(name: str, world: int, **args):
    text = (stdlib_dir() / f"{name}.ssp").read_text()
    return elaborate_text(text, f"{name}.ssp", world=world, args=args).directives


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 7), (1, 3), (4, 2)])
def test_stdlib_zb_h1_equals_builder_and_checks(p, m):
    lowered = lower_schedule(_stdlib("zb_h1", p, stages=p, microbatches=m))
    assert lowered.schedule.split_backward
    assert lowered.schedule.text() == zb_h1(p, m).text()
    check_schedule(lowered.schedule)


@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (8, 16), (3, 9)])
def test_zb_h1_bubble_against_the_analytic_figures(p, m):
    """F = I = W = 1 (a whole backward 2): 1F1B idles (p - 1)(F + B) per device, ZB-H1
    (p - 1)(F + I - W); at p = 4, m = 8, ZB-H1's bubble is 0.41 of 1F1B's (at most 0.5)."""
    costs = Costs(forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0)
    base = simulate(one_f_one_b(p, m), costs)
    assert base.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    zb = simulate(lower_schedule(_stdlib("zb_h1", p, stages=p, microbatches=m)).schedule, costs)
    idle = (p - 1) * (1 + 1 - 1)
    assert zb.makespan == pytest.approx(m * 3 + idle, abs=1e-12)
    assert zb.bubble_ratio == pytest.approx(idle / (m * 3 + idle), abs=1e-12)
    if (p, m) == (4, 8):
        assert zb.bubble_ratio <= 0.5 * base.bubble_ratio
    # the weight halves wait, the activations they need do not pile up past 1F1B's peak
    assert max(zb.peak_activations) == max(base.peak_activations) == min(p, m)


def _torch_zbv_order(p: int, m: int) -> list[str]:
    """Each rank's actions in torch's ScheduleZBVZeroBubble, as unit text (no process group:
    only the order's computation runs)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    sched = object.__new__(schedules.ScheduleZBVZeroBubble)
    sched.pp_group_size, sched.num_stages, sched._n_microbatches = p, 2 * p, m
    if not hasattr(sched, "_calculate_single_rank_operations"):
        pytest.skip("this torch computes the ZB-V order elsewhere")
    return [" ".join(f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}"
                     for a in sched._calculate_single_rank_operations(r) if a is not None)
            for r in range(p)]


@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (4, 8), (3, 5), (4, 7)])
def test_stdlib_zb_v_is_torchs_order_and_checks(p, m):
    lowered = lower_schedule(_stdlib("zb_v", p, stages=p, microbatches=m))
    schedule = lowered.schedule
    assert schedule.split_backward
    assert [schedule.stages.devices[s] for s in range(2 * p)] == \
        [*range(p), *reversed(range(p))]  # the V
    assert [" ".join(str(u) for u in prog.units) for prog in schedule.programs] == \
        _torch_zbv_order(p, m)
    check_schedule(schedule)


def test_zb_v_bubble_is_below_zb_h1s_at_the_same_activation_peak():
    """The same model on 4 devices, 8 micro-batches: ZB-V's 8 virtual stages do half a stage's
    work each (F = I = W = 1/2). Its bubble is below ZB-H1's, and a device holds at most 2 p
    half-stage micro-batches, the activations of ZB-H1's (and 1F1B's) p whole ones."""
    p, m = 4, 8
    zbv = simulate(lower_schedule(_stdlib("zb_v", p, stages=p, microbatches=m)).schedule,
                   Costs(forward=0.5, input_grad=0.5, weight_grad=0.5))
    zbh1 = simulate(zb_h1(p, m), Costs(forward=1.0, input_grad=1.0, weight_grad=1.0))
    assert sum(zbv.busy) == pytest.approx(sum(zbh1.busy))
    assert zbv.bubble_ratio < 0.6 * zbh1.bubble_ratio
    assert max(zbv.peak_activations) == 2 * p and max(zbh1.peak_activations) == p


def test_zb_v_with_too_few_microbatches_is_refused_at_the_require():
    from ssdsl.errors import SsdslError
    with pytest.raises(SsdslError) as info:
        _stdlib("zb_v", 4, stages=4, microbatches=4)
    assert "2 * stages - 1" in str(info.value) and info.value.span.file == "zb_v.ssp"


WRONG = """plan wrong()
microbatch along batch into 2
stages into 2 as st
assign st[0] to device 0
assign st[1] to device 1
order on device 0: forward st[0] mb 0..2, input_grad st[0] mb 0..2, weight_grad st[0] mb 0..2
order on device 1: forward st[1] mb 0..2, {dev1}
"""


def _schedule_of(tmp_path: Path, dev1: str):
    f = tmp_path / "wrong.ssp"
    f.write_text(WRONG.format(dev1=dev1))
    return lower_schedule(elaborate_file(str(f), world=2).directives).schedule


def _first(err: BaseException) -> BaseException:
    return err.errors[0] if isinstance(err, ErrorGroup) else err


def test_weight_half_before_its_input_half_is_refused_at_its_line(tmp_path):
    schedule = _schedule_of(tmp_path, "weight_grad st[1] mb 0, input_grad st[1] mb 0..2, "
                                      "weight_grad st[1] mb 1")
    with pytest.raises((OrderAgainstData, ErrorGroup)) as info:
        check_schedule(schedule)
    err = _first(info.value)
    assert isinstance(err, OrderAgainstData)
    assert err.span.file.endswith("wrong.ssp") and err.span.line == 7


def test_missing_input_half_is_refused_at_its_line(tmp_path):
    schedule = _schedule_of(tmp_path, "input_grad st[1] mb 0, weight_grad st[1] mb 0..2")
    with pytest.raises((MissingUnit, ErrorGroup)) as info:
        check_schedule(schedule)
    err = _first(info.value)
    assert isinstance(err, MissingUnit)
    assert "no input-gradient for micro-batch 1" in str(err)
    assert err.span.file.endswith("wrong.ssp") and err.span.line == 7


@pytest.fixture(scope="module")
def lowered_zb():
    graph = trace(load_model_file(str(GPT)), device="meta")
    t, low = schedule_plan(graph, elaborate_file("zb_h1", world=2, sets={"microbatches": "4"}))
    m = materialize(t, schedule=low)
    return m, lower_plan(m).programs


def test_lowered_zb_h1_programs_pass_and_read_back(lowered_zb):
    m, progs = lowered_zb
    check_programs(progs, m=m)
    for p in progs:
        assert parse_program(program_text(p)) == p
        kinds = {ins.kind for ins in p.instructions}
        assert "backward_weight" in kinds and "backward" not in kinds
        # the first stage receives no activation (the tied embedding is its own, not sent: its
        # I is empty, its W does the whole backward); the second receives one every micro-batch
        assert ("backward_input" in kinds) == (p.rank == 1)


def _blocks(instructions):
    """The instructions as (unit or None, block) runs: a unit's begin..end, or what lies between."""
    out, cur, unit = [], [], None
    for ins in instructions:
        if ins.kind == "begin":
            if cur:
                out.append((None, cur))
            cur, unit = [ins], ins.unit
        elif ins.kind == "end":
            out.append((unit, cur + [ins]))
            cur, unit = [], None
        else:
            cur.append(ins)
    if cur:
        out.append((None, cur))
    return out


def test_program_with_a_weight_unit_before_its_input_unit_is_refused(lowered_zb):
    """Rank 1's W unit of micro-batch 0 moved before its I unit: refused at a plan line."""
    m, progs = lowered_zb
    blocks = _blocks(progs[1].instructions)
    units = [u for u, _ in blocks]
    w, i = units.index("1W0"), units.index("1I0")
    blocks.insert(i, blocks.pop(w))
    bad = attrs.evolve(progs[1], instructions=tuple(x for _, b in blocks for x in b))
    with pytest.raises(ProgramError) as info:
        check_programs((progs[0], bad), m=m)
    assert isinstance(info.value, BadUnitStructure) and "1W0" in str(info.value)
    assert info.value.span is not None and info.value.span.file.endswith("zb_h1.ssp")


def test_split_backward_with_recompute_is_refused_at_the_recompute_line(tmp_path):
    f = tmp_path / "zbr.ssp"
    f.write_text("plan zbr()\nuse zb_h1(stages=2, microbatches=2)\nrecompute h.*.mlp\n")
    graph = trace(load_model_file(str(GPT)), device="meta")
    with pytest.raises(SplitBackwardWithRecompute) as info:
        schedule_plan(graph, elaborate_file(str(f), world=2))
    assert info.value.span.file.endswith("zbr.ssp") and info.value.span.line == 3
