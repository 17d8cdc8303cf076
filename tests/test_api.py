"""`ssdsl.parallelize`: a user's own loop on every rank trains exactly like the single-device model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime.launch import launch
from ssdsl.runtime.reference import run_reference
from ssdsl.runtime.train import OptimizerSpec
from ssdsl.trace.model_file import load_model_file

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")


def user_script(model: str, plan: str, steps: int) -> dict:
    """What a user writes: their own batches and loop around parallelize()."""
    import ssdsl

    pm = ssdsl.parallelize(model, plan, dtype="float64", optimizer="sgd")
    mf = load_model_file(model)
    losses = []
    for step in range(steps):
        inputs, target = mf.get_batch(step, mf.batch_size)
        losses.append(pm.train_step(inputs, target))
    state = pm.full_state_dict()
    return {"losses": losses, "state": state if pm.rank == 0 else None,
            "n_local": sum(p.numel() for p in pm.parameters()),
            "forward": pm.communication()["forward"]}


@pytest.mark.slow  # two rank processes
def test_parallelize_megatron_matches_reference():
    results = launch(user_script, nproc=2, args=(GPT, "megatron_tp", 2), timeout_s=300)
    ref = run_reference(load_model_file(GPT), steps=2, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd"))
    r0 = results[0]
    for got, want in zip(r0["losses"], ref.losses, strict=True):
        assert abs(got - want) <= 1e-10 * abs(want)
    for name, value in r0["state"].items():
        torch.testing.assert_close(value, ref.final_state[name], rtol=1e-9, atol=1e-12)
    plain = load_model_file(GPT).build(seed=0).double()
    plain.load_state_dict(r0["state"])  # strict: tied lm_head.weight under both names
    # each rank holds only its shards: less than the whole model
    whole = sum(v.numel() for k, v in ref.final_state.items() if k != "wte.weight")
    assert all(r["n_local"] < whole for r in results)
    assert set(r0["forward"]) == {"all_reduce"}


def module_script(steps: int) -> dict:
    """A user with a module of their own and a batch function, no model file."""
    import ssdsl
    from ssdsl.api import BatchShapeError
    from ssdsl.errors import UsageError

    torch.manual_seed(1234 + int(__import__("os").environ["RANK"]))  # ranks differ: rank 0 wins
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    def get_batch(step: int, batch_size: int):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 6, generator=g), torch.randint(0, 3, (batch_size,),
                                                                      generator=g)

    errors = {}
    try:
        ssdsl.parallelize(42, "dp")
    except UsageError as err:
        errors["type"] = err.message
    pm = ssdsl.parallelize(model, "dp", batch=get_batch, batch_size=8, dtype="float64",
                           optimizer="sgd")
    try:
        pm.train_step(*get_batch(0, 4))
    except BatchShapeError as err:
        errors["shape"] = err.message + " | " + (err.hint or "")
    losses = [pm.train_step(*get_batch(step, 8)) for step in range(steps)]
    state = pm.full_state_dict()

    def drawn_anew(step: int, batch_size: int):  # a batch function each rank would draw apart
        return torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,))
    try:
        ssdsl.parallelize(model, "dp", batch=drawn_anew, batch_size=8)
    except ssdsl.errors.SsdslError as err:
        errors["batch"] = type(err).__name__
    v = pm.verification
    return {"losses": losses, "state": state, "initial": initial, "errors": errors,
            "verified": (v.status, v.loss)}


@pytest.mark.slow
def test_parallelize_a_module_with_a_batch_function():
    results = launch(module_script, nproc=2, args=(2,), timeout_s=300)
    r0 = results[0]
    # the oracle: a plain loop on rank 0's module
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.load_state_dict(r0["initial"])
    model.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, got in enumerate(r0["losses"]):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.double()), y)
        if step == 0:  # a module is verified before training, against a copy of itself
            status, simulated = r0["verified"]
            assert status == "verified" and abs(simulated - loss.item()) <= 1e-12

        loss.backward()
        opt.step()
        assert abs(got - loss.item()) <= 1e-12 * loss.item()
    assert results[1]["losses"] == r0["losses"]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(r0["state"][name], value, rtol=1e-12, atol=1e-14)
    assert "nn.Module, not int" in r0["errors"]["type"]
    assert r0["errors"]["batch"] == "NonDeterministicBatch"
    shape = r0["errors"]["shape"]
    assert "input 0 has shape (4, 6) (batch size 4)" in shape and "(8, 6)" in shape
    assert "batch_size=4" in shape
