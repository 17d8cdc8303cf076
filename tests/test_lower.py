"""Lowered per-rank programs: they read back, say every communication explicitly, and train
exactly like one device when every rank's program is simulated in one process.

Oracles: the plain single-device model (``run_reference`` through ``compare_with_model``: loss
and every gradient of step 0, float64) for the simulated programs; the schedule phase's unit
programs for the order of units; the materialized adapters (which ranks each adapter involves)
for which edges a rank communicates on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_file
from ssdsl.lower import lower_plan, parse_program, program_text
from ssdsl.lower.instr import Comm, Coll
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.runtime.verify import compare_with_model, simulate_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")


def _plan(plan: str, world: int, *, device: str = "meta", tmp: Path | None = None, **sets):
    mf = load_model_file(GPT)
    model = mf.build(seed=0).to(torch.float64) if device == "cpu" else None
    graph = trace(mf, device=device, model=model)
    if tmp is not None:
        (tmp / "p.ssp").write_text(plan)
        plan = str(tmp / "p.ssp")
    t, low = schedule_plan(graph, elaborate_file(plan, world=world,
                                                 sets={k: str(v) for k, v in sets.items()}))
    return mf, materialize(t, dtype=torch.float64, schedule=low)


CASES = {
    "1f1b": ("1f1b", 4, {"microbatches": 8}),
    "interleaved": ("interleaved_1f1b", 4, {"chunks": 2, "microbatches": 4}),
    "dp_tp_1f1b": ("dp_tp_1f1b", 8, {"dp": 2, "tp": 2, "microbatches": 4}),
    "megatron_tp": ("megatron_tp", 2, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_programs_read_back_and_follow_the_schedule(case):
    plan, world, sets = CASES[case]
    _, m = _plan(plan, world, **sets)
    programs = lower_plan(m).programs
    for p in programs:
        assert parse_program(program_text(p)) == p
        if m.schedule is not None:
            rank = next(r for r, g in enumerate(m.schedule.groups) if p.rank in g)
            assert list(p.units) == [str(u) for u in m.schedule.schedule.programs[rank].units]
    # a rank has comm instructions exactly for the edges whose adapters move data for it
    for key, edge in m.edges.items():
        i = list(m.edges).index(key)
        for p in programs:
            comms = [x for x in p.instructions if isinstance(x, Comm) and x.edge == i]
            if p.rank not in edge.adapter.devices:
                assert not comms, (key, p.rank)


def test_backward_collectives_run_in_reverse_forward_order():
    """Megatron: each rank's backward all-reduces (one before each column-parallel linear) come in
    the reverse order of the forward, written in the program on both ranks alike."""
    _, m = _plan("megatron_tp", 2)
    orders = []
    for p in lower_plan(m).programs:
        fwd = [x.edge for x in p.instructions if isinstance(x, Comm) and not x.backward
               and any(isinstance(s, Coll) and s.meets for s in x.steps)]
        bwd = [x.edge for x in p.instructions if isinstance(x, Comm) and x.backward
               and any(isinstance(s, Coll) and s.meets for s in x.steps)]
        cols = [x.edge for x in p.instructions if isinstance(x, Comm) and not x.backward
                and x.edge in bwd]
        assert bwd == cols[::-1] and len(fwd) == len(bwd) == 4
        orders.append(bwd)
    assert orders[0] == orders[1]


SIM = {
    "1f1b": ("1f1b", 4, {"microbatches": 4}),
    "interleaved": ("interleaved_1f1b", 4, {"chunks": 2, "microbatches": 4}),
    "megatron_tp": ("megatron_tp", 4, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SIM))
def test_simulated_programs_match_the_plain_model(case):
    plan, world, sets = SIM[case]
    mf, m = _plan(plan, world, device="cpu", **sets)
    sim = simulate_plan(m, mf)
    problems, ref_loss, worst = compare_with_model(m, mf, sim)
    assert not problems, problems[:5]
    assert sim.loss == pytest.approx(ref_loss, rel=1e-12) and worst < 1e-10


@pytest.mark.slow
def test_recompute_next_to_communication_is_kept_and_exact(tmp_path):
    """Megatron with `recompute h.*.attn`: the recomputed runs stop at each all-reduce (nothing
    communicates inside a region) instead of dropping the operators next to it, and the step
    stays exact."""
    text = ("plan p()\nuse megatron_tp(tp = world)\nrecompute h.*.attn\n")
    mf, m = _plan(text, 2, device="cpu", tmp=tmp_path)
    programs = lower_plan(m).programs
    for p in programs:
        inside, seen = False, set()
        for x in p.instructions:
            inside = (inside or x.kind == "recompute") and x.kind != "end_recompute"
            assert not (inside and x.kind == "comm")
            if inside and x.kind == "call":
                seen.add(x.op)
        proj = [op.name for op in m.transformed.graph.ops
                if op.module.endswith("attn.c_proj") and op.kind == "linear"]
        assert set(proj) <= seen  # the row-parallel linear feeding an all-reduce is recomputed
    sim = simulate_plan(m, mf)
    problems, _, worst = compare_with_model(m, mf, sim)
    assert not problems and worst < 1e-10
