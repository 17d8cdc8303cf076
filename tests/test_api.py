"""`ssdsl.parallelize`: a user's own loop on every rank trains exactly like the single-device model."""

from __future__ import annotations

from pathlib import Path

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
