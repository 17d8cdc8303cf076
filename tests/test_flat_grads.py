"""Gradient buckets through flat buffers made once (``ssdsl.runtime.flat``).

The unit tests hold the buffer to ``torch.cat`` of the gradients written out by hand; the
distributed test holds a 2-rank ``dp`` run, whose one bucket is reduced in place in its flat
buffer, to the plain model trained in this process (float64, SGD) over steps that reuse it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime import flat
from ssdsl.runtime.flat import flat_grads
from ssdsl.runtime.launch import launch
from tests.plain_reference import assert_trains_like, plain_sgd
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
LR, STEPS = 0.05, 3


def _leaves(*shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def test_fill_lays_the_gradients_and_the_loss_end_to_end():
    leaves = _leaves((3, 2), (4,), (2, 2))
    grads = [torch.randn(3, 2), torch.randn(4), torch.randn(2, 2).t()]  # one not contiguous
    for leaf, g in zip(leaves, grads):
        leaf.grad = g.clone()
    f = flat_grads(leaves, loss=True)
    buf = f.fill(leaves, torch.tensor(2.5, dtype=torch.float64, requires_grad=True))
    want = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([2.5])])
    assert torch.equal(buf, want)
    assert not buf.requires_grad  # a loss that needs a gradient is copied, not recorded
    buf.mul_(2)  # what an all-reduce of two equal members writes
    f.hand_out(leaves)
    for leaf, g in zip(leaves, grads):
        assert torch.equal(leaf.grad, 2 * g)
        assert leaf.grad.data_ptr() >= buf.data_ptr()  # a view of the buffer
    assert f.loss() == 5.0


def test_a_weight_without_gradient_gives_zeros_and_a_second_step_overwrites_the_first():
    leaves = _leaves((2,), (3,))
    f = flat_grads(leaves, loss=False)
    leaves[0].grad = torch.ones(2)
    leaves[1].grad = torch.full((3,), 7.0)
    f.fill(leaves)
    f.hand_out(leaves)
    for leaf in leaves:  # the next step: zero_grad(set_to_none=True), one weight reached
        leaf.grad = None
    leaves[0].grad = torch.full((2,), 3.0)
    buf = f.fill(leaves)
    assert torch.equal(buf, torch.tensor([3.0, 3.0, 0.0, 0.0, 0.0]))


def test_a_gradient_that_is_its_view_already_keeps_its_value():
    leaves = _leaves((2,), (2,))
    f = flat_grads(leaves, loss=False)
    for leaf in leaves:
        leaf.grad = torch.full((2,), 4.0)
    f.fill(leaves)
    f.hand_out(leaves)  # not dropped before the next fill (a weight no optimizer steps)
    assert torch.equal(f.fill(leaves), torch.full((4,), 4.0))


def test_no_flat_buffer_for_mixed_dtypes_no_leaves_or_the_lever_off(monkeypatch):
    assert flat_grads(_leaves((2,)) + _leaves((2,), dtype=torch.float64), loss=False) is None
    assert flat_grads([], loss=True) is None
    monkeypatch.setattr(flat, "ENABLED", False)
    assert flat_grads(_leaves((2,)), loss=False) is None


def dp_worker(flat_on: bool) -> tuple[list[float], dict, dict]:
    import ssdsl
    from ssdsl.runtime import flat as flat_mod

    flat_mod.ENABLED = flat_on
    mf = load_model_file(GPT)
    pm = ssdsl.parallelize(GPT, "dp", optimizer="sgd", lr=LR, dtype="float64", verify=False)
    losses = [pm.train_step(*mf.get_batch(s, mf.batch_size)) for s in range(STEPS)]
    return losses, pm.full_state_dict(), dict(pm._program.runner.counts)


@pytest.mark.slow
@pytest.mark.parametrize("flat_on", [True, False])
def test_dp_through_the_flat_buffer_trains_like_the_plain_model(flat_on):
    per_rank = launch(dp_worker, nproc=2, args=(flat_on,), timeout_s=600)
    want = plain_sgd(GPT, STEPS, LR)
    for losses, state, counts in per_rank:
        assert_trains_like(losses, state, want)
        # the buffer did carry every step's bucket (or, off, none)
        assert counts["flat_reduced"] == (STEPS if flat_on else 0)
