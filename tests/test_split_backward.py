"""Split backward (zero-bubble units): ``input_grad`` and ``weight_grad`` halves run for real.

In one process (every stage on device 0, world 1) the pipeline machinery runs as it does on
ranks: each stage's input-gradient unit starts from the gradient a later stage left, and its
weight-gradient unit runs later, after other micro-batches' units. The oracle is the
single-device model trained by ``run_reference`` (plain PyTorch on the whole batch), in float64:
the loss and every gradient of step 0, and the parameters after two SGD steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_file
from ssdsl.runtime.executor import assemble
from ssdsl.runtime.reference import norm_scaled_errors, run_reference
from ssdsl.runtime.train import OptimizerSpec

from tests.test_pipeline_inprocess import _check_two_steps, _program

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
MLP = ROOT / "examples" / "mlp.py"
SGD = OptimizerSpec("sgd", 0.1)


THREE_STAGES = """plan p(mbs: int = 4)
microbatch along batch into mbs
stages into 3 as st
for s in 0..3:
    assign st[s] to device 0
order on device 0:
    forward st[0] mb 0..mbs, forward st[1] mb 0..mbs, forward st[2] mb 0..mbs,
    input_grad st[2] mb 0..mbs, input_grad st[1] mb 0..mbs, input_grad st[0] mb 0..mbs,
    weight_grad st[0] mb 0..mbs, weight_grad st[2] mb 0..mbs, weight_grad st[1] mb 0..mbs
"""


@pytest.mark.parametrize("model", [GPT, MLP], ids=["gpt", "mlp"])
def test_weight_halves_after_every_input_half_match_the_reference(tmp_path, model):
    prog, mf = _program(tmp_path, THREE_STAGES, model)
    kinds = [ins.kind for ins in prog.program.instructions]
    assert "backward" not in kinds
    assert kinds.count("backward_input") and kinds.count("backward_weight")
    _check_two_steps(prog, mf)


def test_the_input_half_computes_no_weight_gradient(tmp_path):
    """After every forward and input-gradient unit no parameter has a gradient yet; the weight
    units give every parameter one (the oracle of their values is the test above)."""
    prog, _ = _program(tmp_path, THREE_STAGES)
    inputs, target = prog.mf.get_batch(0, None)
    prog.opt.zero_grad(set_to_none=True)
    prog.begin((*inputs, target))
    units = prog.program.units
    for u in units:
        if "W" not in u:
            prog.run_unit(u)
    assert all(leaf.grad is None for leaf in prog.state.leaves.values())
    assert prog.runner.kept  # the output gradients the weight half starts from
    for u in units:
        if "W" in u:
            prog.run_unit(u)
    assert all(leaf.grad is not None for leaf in prog.state.leaves.values())
    assert not prog.runner.kept


WHOLE = THREE_STAGES.split("order on device 0:")[0] + """order on device 0:
    forward st[0] mb 0..mbs, forward st[1] mb 0..mbs, forward st[2] mb 0..mbs,
    backward st[2] mb 0..mbs, backward st[1] mb 0..mbs, backward st[0] mb 0..mbs
"""


def _flops_per_pass(tmp_path: Path, text: str) -> dict[str, int]:
    from torch.utils.flop_counter import FlopCounterMode
    prog, mf = _program(tmp_path, text)
    inputs, target = mf.get_batch(0, None)
    prog.opt.zero_grad(set_to_none=True)
    prog.begin((*inputs, target))
    total: dict[str, int] = {}
    for u in prog.program.units:
        counter = FlopCounterMode(display=False)
        with counter:
            prog.run_unit(u)
        total[u[:2]] = total.get(u[:2], 0) + counter.get_total_flops()
    return total


def test_the_halves_split_the_backward_products_without_repeating_any(tmp_path):
    """Counted by torch's FLOP counter: per stage, I + W do exactly the products of the whole
    backward B (of the plan with whole backwards); in the middle stage (blocks only: its
    counted products are the linears, each of a weight and a received operand; the counter does
    not count CPU attention's kernel) I and W each do the forward's count (a linear's input
    gradient and weight gradient are each one product of the forward's size); the first stage
    received nothing, so its I is empty."""
    whole = _flops_per_pass(tmp_path, WHOLE)
    split = _flops_per_pass(tmp_path, THREE_STAGES)
    for s in range(3):
        assert split[f"{s}I"] + split[f"{s}W"] == whole[f"{s}B"]
    assert split["1I"] == split["1W"] == split["1F"] > 0
    assert split["0I"] == 0 and split["0W"] == whole["0B"]


def test_generated_module_runs_the_split_backward(tmp_path):
    """`ssdsl compile`'s per-rank module of the split plan (units, weight cuts and both halves
    written out) trains like the single-device model."""
    from ssdsl.codegen import Provenance, generate_rank
    from ssdsl.runtime.compiled import GeneratedRankProgram, load_module
    from ssdsl.runtime.job import JobSpec, plan_job

    plan = tmp_path / "p.ssp"
    plan.write_text(THREE_STAGES)
    (tmp_path / "rank0.py").write_text("# written below\n")
    spec = JobSpec(str(GPT), str(plan), (), dtype="float64", optimizer="sgd", lr=0.1,
                   compiled=str(tmp_path))
    mf, m, full = plan_job(spec, 1)
    text = generate_rank(m, 0, Provenance.of(GPT, elaborate_file(str(plan), world=1)))
    assert "input-gradient half" in text and "weight-gradient half" in text
    prog = GeneratedRankProgram(m, 0, mf, full, module=load_module(text), dtype=torch.float64,
                                optimizer=SGD, groups=None)
    losses = [prog.step(step, None) for step in range(2)]
    ref = run_reference(mf, steps=2, dtype=torch.float64, optimizer=SGD)
    assert losses == pytest.approx(list(ref.losses), rel=1e-10)
    final = assemble(prog.shards())
    errors = norm_scaled_errors({k: ref.final_state[k] for k in final}, final)
    assert max(errors.values()) < 1e-10


SPLIT_TP = """plan tz()
use megatron_tp(tp=2, placed=false)
stages into 1 as st
assign st[0] to devices 0..2
order on devices 0..2: forward st[0] mb 0, input_grad st[0] mb 0, weight_grad st[0] mb 0
"""
SPLIT_3D = """plan dtz()
mesh m = grid(pp=2, dp=2, tp=2)
partition all along batch into 2
use megatron_tp(tp=2, placed=false)
use zb_h1(stages=2, microbatches=4, width=4)
"""


@pytest.mark.parametrize("text, world", [(SPLIT_TP, 2), (SPLIT_3D, 8)], ids=["tp2", "3d"])
def test_split_backward_inside_tensor_parallel_stages(tmp_path, text, world):
    """Every rank of a plan whose split-backward stages are tensor (and data) parallel, in one
    process (``simulate_model_file``, the same programs): each shard's reduced gradient equals
    its region of the single-device gradient. Inside a stage the autograd graph is cut at every
    collective, and a cut made in one segment can be read by the next (found by this test: the
    input half lost that gradient)."""
    from ssdsl.lower import lower_plan
    from ssdsl.runtime.job import JobSpec, plan_job
    from ssdsl.runtime.simulate import simulate_model_file

    plan = tmp_path / "p.ssp"
    plan.write_text(text)
    spec = JobSpec(str(GPT), str(plan), (), 1, dtype="float64", optimizer="sgd")
    mf, m, _ = plan_job(spec, world)
    sim = simulate_model_file(m, lower_plan(m).programs, mf)
    ref = run_reference(mf, steps=1, dtype=torch.float64, optimizer=SGD, grad_steps=(0,))
    assert sim.loss == pytest.approx(ref.losses[0], rel=1e-12, abs=0)
    params, aliases = m.transformed.graph.params, m.transformed.graph.aliases
    worst = 0.0
    for grads in sim.grads.values():
        for (name, region), g in grads.items():
            qual = next(q for q in (params[name], *aliases.get(params[name], ()))
                        if q in ref.grads[0])
            want = region.slice_of(ref.grads[0][qual])
            worst = max(worst, float((g - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    assert worst < 1e-10
