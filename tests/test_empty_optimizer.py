"""A rank whose operators read no parameter (a pipeline stage that holds the loss alone) still
gets an optimizer: torch refuses an empty parameter list, so the rank stepped nothing but died
while building its shards. Oracle: torch's own optimizers on the same empty step (nothing
changes), and a parameterised rank beside it unaffected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime.train import OptimizerSpec, build_optimizer
from ssdsl.trace.model_file import load_model_file

MLP = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")


@pytest.mark.parametrize("kind", ["model", "sgd", "adamw"])
def test_an_empty_parameter_list_gets_an_optimizer_that_steps_nothing(kind):
    mf = load_model_file(MLP)
    opt = build_optimizer(OptimizerSpec(kind), mf, [])
    opt.zero_grad()
    opt.step()
    assert all(p.numel() == 0 for g in opt.param_groups for p in g["params"])
    # a rank with parameters is built as before: the same class and learning rate as torch's
    w = torch.nn.Parameter(torch.ones(3))
    full = build_optimizer(OptimizerSpec(kind), mf, [w])
    assert type(full) is type(opt)
    assert full.param_groups[0]["params"] == [w]
    assert full.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
