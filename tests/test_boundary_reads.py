"""A value that crosses a pipeline stage boundary is sent once per micro-batch and receiving
device, however many operators read it there (``ssdsl.materialize.boundary``).

Stages cut at block starts make the residual stream the boundary: the next block reads it twice
(its first layer norm and its residual add). Oracles: the traced graph (the boundary value has
two or more readers on the receiving stage, so without the rule each would be sent), and the
plain single-device model (loss and every gradient of step 0 in float64, every rank's lowered
program simulated in one process; for the slow test, three SGD steps of real ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.check.program import check_programs
from ssdsl.elaborate import elaborate_file
from ssdsl.lower import lower_plan
from ssdsl.lower.instr import Comm
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.runtime.launch import launch
from ssdsl.runtime.verify import compare_with_model, simulate_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file
from tests.plain_reference import assert_trains_like, plain_sgd

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")

ORDERS = """
for s in 0..2:
    assign st[s] to devices s * width..(s + 1) * width
    let warm = min(1 - s, mbs)
    order on devices s * width..(s + 1) * width:
        forward st[s] mb 0..warm,
        interleave(forward st[s] mb warm..mbs, backward st[s] mb 0..mbs - warm),
        backward st[s] mb mbs - warm..mbs
"""
ONE_F_ONE_B = ("plan p(mbs: int = 4, width: int = 1)\nmicrobatch along batch into mbs\n"
               "stages h.0, h.1 as st\n" + ORDERS)
RECOMPUTED = ONE_F_ONE_B.replace("as st\n", "as st\nrecompute st[1]\n")
DP_TP = ("plan p(mbs: int = 2, width: int = 4)\npartition all along batch into 2\n"
         "use megatron_tp(tp=2, placed=false)\nmicrobatch along batch into mbs\n"
         "stages h.0, h.1 as st\n" + ORDERS)
# ZB-H1 with the same cut (split backward: input and weight halves)
ZB_H1 = (ROOT / "stdlib_plans" / "zb_h1.ssp").read_text().replace(
    "stages into stages as st", "stages h.0, h.1 as st")
CASES = {"1f1b": (ONE_F_ONE_B, 2), "recompute": (RECOMPUTED, 2), "dp_tp": (DP_TP, 8),
         "zb_h1": (ZB_H1, 2)}


def _materialize(text: str, world: int, tmp: Path):
    mf = load_model_file(GPT)
    graph = trace(mf, device="cpu", model=mf.build(seed=0).to(torch.float64))
    (tmp / "p.ssp").write_text(text)
    t, low = schedule_plan(graph, elaborate_file(str(tmp / "p.ssp"), world=world))
    return mf, t, materialize(t, dtype=torch.float64, schedule=low)


def _boundary(t) -> str:
    """The value of stage 0 that two or more operator inputs of stage 1 read (traced graph)."""
    producer = t.graph.producer()
    reads: dict[str, int] = {}
    for op in t.graph.ops:
        for name in op.inputs:
            if name in producer and t.stage(producer[name].name) == 0 and t.stage(op.name) == 1:
                reads[name] = reads.get(name, 0) + 1
    many = [name for name, n in reads.items() if n >= 2]
    assert len(many) == 1, reads  # the residual stream (the precondition of this test)
    return many[0]


def _messages(m, programs, tensor: str) -> dict[tuple[int, int, bool, str], int]:
    """(rank, micro-batch, backward, kind) -> messages of ``tensor``'s edges (any consumer)."""
    keys = list(m.edges)
    out: dict[tuple[int, int, bool, str], int] = {}
    for p in programs:
        for x in p.instructions:
            if isinstance(x, Comm) and keys[x.edge][0] == tensor:
                for step in x.steps:
                    for msg in getattr(step, "msgs", ()):
                        key = (p.rank, x.mb, x.backward, msg.kind)
                        out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_boundary_value_crosses_once_and_trains_like_one_device(case, tmp_path):
    text, world = CASES[case]
    mf, t, m = _materialize(text, world, tmp_path)
    boundary = _boundary(t)
    programs = lower_plan(m).programs
    check_programs(programs, m=m)
    counts = _messages(m, programs, boundary)
    width = world // 2
    mbs = m.transformed.microbatches
    for mb in range(mbs):  # per micro-batch: one send and one receive per device each way
        for rank in range(width):
            assert counts.get((rank, mb, False, "send")) == 1, counts
            assert counts.get((rank, mb, True, "recv")) == 1, counts
        for rank in range(width, world):
            assert counts.get((rank, mb, False, "recv")) == 1, counts
            assert counts.get((rank, mb, True, "send")) == 1, counts
    assert sum(counts.values()) == 4 * mbs * width
    sim = simulate_plan(m, mf)
    problems, _, _ = compare_with_model(m, mf, sim)
    assert not problems, problems


# -- real ranks --------------------------------------------------------------------------------


def boundary_worker(plan: str, steps: int) -> tuple[list[float], dict]:
    import ssdsl
    mf = load_model_file(GPT)
    pm = ssdsl.parallelize(GPT, plan, optimizer="sgd", lr=0.05, dtype="float64", verify=False)
    losses = [pm.train_step(*mf.get_batch(s, mf.batch_size)) for s in range(steps)]
    return losses, pm.full_state_dict()


@pytest.mark.slow
def test_deduplicated_pipeline_trains_like_one_device_on_two_ranks(tmp_path):
    (tmp_path / "p.ssp").write_text(ONE_F_ONE_B)
    got = launch(boundary_worker, nproc=2, args=(str(tmp_path / "p.ssp"), 3), timeout_s=600)
    want = plain_sgd(GPT, 3, 0.05)
    for rank_losses, state in got:
        assert_trains_like(rank_losses, state, want)


TP_PP = """plan tp_pp(stages: int = 2, microbatches: int = 2, width: int = 2)
mesh m = grid(pp=2, dp=1, tp=2)
use megatron_tp(tp=2, blocks="lm.model.layers.*", attn="self_attn", attn_out="self_attn.o_proj", mlp="mlp", mlp_out="mlp.down_proj", placed=false)
microbatch along batch into microbatches
stages lm.model.embed_tokens, {cut} as st
"""


@pytest.mark.parametrize("cut", ["lm.model.layers.1.self_attn.k_proj", "lm.model.layers.1.mlp",
                                 "lm.model.layers.1"])
def test_tensor_parallel_readers_across_a_stage_cut_train_like_one_device(cut, tmp_path):
    """A pipeline cut inside a tensor-parallel block (automatic stages cut LLaMA between its q
    and its k, v projections, or before the gate and up projections): two column-parallel
    readers on the later stage of one value from the earlier one, whose input gradients are
    partial sums. The boundary identity (one message for both) once took them, and the two
    readers' gradients reached it as two sums of which one was lost: wrong gradients on every
    earlier stage. The oracle is the plain model, one step simulated in float64."""
    from ssdsl.resources import stdlib_dir
    body = (stdlib_dir() / "1f1b.ssp").read_text()
    plan = tmp_path / "tp_pp.ssp"
    plan.write_text(TP_PP.format(cut=cut) + body[body.index("for s in 0..stages:"):])
    mf = load_model_file(str(ROOT / "examples" / "hf_llama.py"))
    graph = trace(mf, device="cpu", model=mf.build(seed=0).to(torch.float64))
    t, lowered = schedule_plan(graph, elaborate_file(str(plan), world=4))
    m = materialize(t, dtype=torch.float64, schedule=lowered)
    check_programs(lower_plan(m).programs, m=m)
    problems, _, _ = compare_with_model(m, mf, simulate_plan(m, mf))
    assert not problems, problems
