"""Verification before launch must not take a NaN for a match: a simulated loss or gradient
entry that is NaN where the plain model's is finite compares false with any tolerance, so the
old ``err > rtol`` tests let it pass ("matches the plain model (loss nan, worst gradient error
nan)"). The simulation is spoiled by hand here; the oracle is the plain single-device model
(``run_reference`` inside ``verify_before_launch``)."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
import torch

import ssdsl.runtime.verify as verify
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import TrainsDifferently, verify_before_launch

MLP = Path(__file__).resolve().parent.parent / "examples" / "mlp.py"


def _spoil(monkeypatch, *, loss: bool):
    real = verify.simulate_plan

    def spoiled(*args, **kwargs):
        sim = real(*args, **kwargs)
        if loss:
            return attrs.evolve(sim, loss=math.nan)
        dev, mine = next(iter(sorted(sim.grads.items())))
        key, grad = next(iter(mine.items()))
        bad = grad.clone()
        bad.view(-1)[0] = math.nan
        grads = dict(sim.grads)
        grads[dev] = {**mine, key: bad}
        return attrs.evolve(sim, grads=grads)

    monkeypatch.setattr(verify, "simulate_plan", spoiled)


@pytest.mark.parametrize("loss", [True, False], ids=["nan-loss", "nan-gradient"])
def test_a_nan_is_not_a_match(monkeypatch, loss):
    spec = JobSpec(str(MLP), "dp")
    assert verify_before_launch(spec, 2).verified  # the plan as it is
    _spoil(monkeypatch, loss=loss)
    with pytest.raises(TrainsDifferently):
        verify_before_launch(spec, 2)


def test_errors_against_an_independent_computation():
    want = torch.tensor([1.0, math.nan, 2.0, math.inf])
    assert verify._max_error(want.clone(), want) == 0.0           # NaN in both: not off
    assert verify._max_error(torch.tensor([1.0, math.nan, 2.5, math.inf]), want) == 0.5
    assert verify._max_error(torch.tensor([1.0, 0.0, 2.0, math.inf]), want) == math.inf
    assert verify._max_error(torch.tensor([1.0, math.nan, 2.0, 3.0]), want) == math.inf
    assert verify._loss_error(math.nan, 2.0) == math.inf
    assert verify._loss_error(math.nan, math.nan) == 0.0
    assert verify._loss_error(3.0, 2.0) == pytest.approx(0.5)


def test_verified_line_says_the_plain_model_is_not_finite():
    """A plan that reproduces a plain model's NaN is verified (the same rule as ``--check``'s
    comparison), and the line says the model itself does not train in that dtype."""
    from ssdsl.runtime.preflight import Verification
    line = Verification("verified", seconds=1.0, dtype="float64", loss=math.nan,
                        reference_loss=math.nan, max_grad_error=0.0).line()
    assert "the plain model's own loss is nan in float64" in line
    fine = Verification("verified", seconds=1.0, dtype="float64", loss=2.5,
                        reference_loss=2.5, max_grad_error=0.0).line()
    assert "note" not in fine
