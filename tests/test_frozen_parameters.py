"""Parameters with ``requires_grad=False`` (Whisper's sinusoidal encoder positions, a frozen
bias): the plain model never gives them a gradient, so no optimizer step moves them. ssdsl
once traced them as parameters, computed a gradient for them and trained them: under dp the
loss of step 1 and the frozen values drifted from the plain model's, silently.

The oracle is plain torch: which parameters autograd gives a gradient, their gradients, and
the state after training the plain model (``run_reference``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_text
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import simulate_plan, verify_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

MODEL = Path(__file__).resolve().parent / "models" / "frozen_table.py"

PLANS = {
    "dp": "partition all along batch into n\n",
    "fc-out": "partition fc along out into n\nreplicate rest into n\n",
    "fc-in": "partition fc along in into n\nreplicate rest into n\n",
}


def _materialized(body: str):
    mf = load_model_file(MODEL)
    graph = trace(mf, device="cpu", model=mf.build(seed=0))
    plan = elaborate_text("plan p(n: int = world)\n" + body + "assign each part i to device i\n",
                          "p.ssp", world=2)
    return mf, materialize(transform(graph, plan), dtype=torch.float64)


def _plain_grads(mf) -> dict[str, torch.Tensor]:
    model = mf.build(seed=0).to(torch.float64)
    (x,), y = mf.get_batch(0, mf.batch_size)
    mf.loss(model(x.to(torch.float64)), y).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", list(PLANS))
def test_frozen_parameters_get_no_gradient(layout: str) -> None:
    mf, m = _materialized(PLANS[layout])
    want = _plain_grads(mf)
    assert sorted(want) == ["fc.weight", "head.bias", "head.weight"]  # the model is as meant
    sim = simulate_plan(m, mf)
    g = m.transformed.graph
    got = {g.params[name] for grads in sim.grads.values() for name, _ in grads}
    assert got == set(want)
    for grads in sim.grads.values():
        for (name, region), grad in grads.items():
            assert torch.allclose(grad, region.slice_of(want[g.params[name]]), rtol=1e-12,
                                  atol=1e-14)
    assert verify_plan(m, model_file=mf).ok


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp", "1f1b"])
def test_frozen_parameters_stay_as_the_plain_model_leaves_them(capsys, tmp_path, plan) -> None:
    from ssdsl.cli import main
    from ssdsl.runtime.reference import OptimizerSpec, run_reference

    saved = tmp_path / "state.pt"
    code = main(["run", str(MODEL), plan, "--nproc", "2", "--check", "--dtype", "float64",
                 "--optimizer", "sgd", "--steps", "2", "--json", "--save", str(saved)])
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    ref = run_reference(load_model_file(MODEL), steps=2, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd"))
    state = torch.load(saved)
    assert sorted(state) == sorted(ref.final_state)
    for k, want in ref.final_state.items():
        assert torch.allclose(state[k].to(want.dtype), want, rtol=1e-12, atol=1e-14), k
    first = load_model_file(MODEL).build(seed=0).state_dict()
    for k in ("positions.weight", "fc.bias"):  # untouched by training, in both
        assert torch.equal(state[k].to(first[k].dtype), first[k])
