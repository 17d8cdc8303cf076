"""Where every rank holds the whole loss (a replicated loss, as under tensor parallelism), each
rank reports it from its own parts, with no collective (``ssdsl.lower.build.own_loss``); where
the loss is split (data parallelism: each rank holds its rows' part; pipelines: the last stage
only), the parts are still summed over all ranks.

Oracle: the plain single-device model's loss (``compare_with_model``, which checks the loss
every rank reports), with every rank's lowered program simulated in one process in float64.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from ssdsl.check.program import check_programs
from ssdsl.elaborate import elaborate_file
from ssdsl.lower import lower_plan
from ssdsl.lower.instr import LossSum
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.runtime.simulate import simulate_model_file
from ssdsl.runtime.verify import compare_with_model
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
_GRAPH: list = []


def _plan(plan: str, world: int, **sets):
    mf = load_model_file(GPT)
    if not _GRAPH:
        _GRAPH.append(trace(mf, device="cpu", model=mf.build(seed=0).to(torch.float64)))
    t, low = schedule_plan(_GRAPH[0], elaborate_file(plan, world=world,
                                                     sets={k: str(v) for k, v in sets.items()}))
    m = materialize(t, dtype=torch.float64, schedule=low)
    programs = lower_plan(m).programs
    check_programs(programs, m=m)
    return mf, m, programs


def _tail(p) -> list:
    return [x for x in p.instructions if x.kind in ("loss_sum", "reduce")]


@pytest.mark.parametrize("plan, world", [("megatron_tp", 2), ("megatron_tp", 4),
                                         ("coshard", 2)])
def test_a_replicated_loss_is_reported_by_every_rank_without_a_collective(plan, world):
    mf, m, programs = _plan(plan, world)
    for p in programs:
        sums = [x for x in p.instructions if x.kind == "loss_sum"]
        assert sums == [attrs.evolve(sums[0], group=(p.rank,))]  # meets no one
        assert not any(x.loss for x in p.instructions if x.kind == "reduce")
    sim = simulate_model_file(m, programs, mf)
    assert set(sim.losses) == set(range(world))
    problems, _, _ = compare_with_model(m, mf, sim)  # every rank's loss is the plain model's
    assert not problems, problems


@pytest.mark.parametrize("plan, world, sets", [("dp", 2, {}), ("1f1b", 2, {}),
                                               ("dp_tp", 4, {"dp": 2, "tp": 2})])
def test_a_split_loss_is_still_summed_over_every_rank(plan, world, sets):
    mf, m, programs = _plan(plan, world, **sets)
    everyone = tuple(range(world))
    for p in programs:
        summed = [x for x in _tail(p) if x.kind == "loss_sum" or x.loss]
        assert len(summed) == 1 and tuple(summed[0].group) == everyone
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


def test_verification_catches_a_rank_reporting_only_its_own_part():
    """Data parallelism with each rank summing alone what it holds (half the batch's loss):
    the collectives still agree, so only the loss each rank reports can tell."""
    mf, m, programs = _plan("dp", 2)
    wrong = []
    for p in programs:
        ins = []
        for x in p.instructions:
            if x.kind == "reduce" and x.loss:
                ins += [attrs.evolve(x, loss=False), LossSum((p.rank,), span=x.span)]
            else:
                ins.append(x)
        wrong.append(attrs.evolve(p, instructions=tuple(ins)))
    check_programs(wrong, m=m)  # well formed: the checker cannot tell
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, wrong, mf))
    assert any("rank 0 reports the loss" in x for x in problems), problems
    assert any("rank 1 reports the loss" in x for x in problems), problems
