"""The oracle of the multi-rank tests: the plain model trained in this process, in float64 with
plain SGD, on the model file's batches."""

from __future__ import annotations

import pytest
import torch

from ssdsl.trace.model_file import load_model_file


def plain_sgd(model_path: str, steps: int, lr: float, *, float_inputs: bool = False
              ) -> tuple[list[float], dict]:
    """The losses of ``steps`` steps and the final state dict; ``float_inputs``: the batch's
    floating inputs in float64 too (as a float64 run casts them)."""
    mf = load_model_file(model_path)
    model = mf.build(seed=0).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        inputs, target = mf.get_batch(s, mf.batch_size)
        if float_inputs:
            inputs = tuple(x.to(torch.float64) if x.is_floating_point() else x for x in inputs)
        opt.zero_grad()
        loss = mf.loss(model(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def assert_trains_like(losses: list[float], state: dict, want: tuple[list[float], dict],
                       tol: float = 1e-10) -> None:
    """A rank's losses and full parameters against ``plain_sgd``'s."""
    assert losses == pytest.approx(want[0], rel=tol)
    for name, w in want[1].items():
        g = state[name].to(torch.float64)
        assert (g - w).norm() <= tol * max(1.0, float(w.norm())), name
