"""Losses that scale, negate or add reductions over the batch (``0.5 * ce``, ``-logp.mean()``,
``ce + 0.01 * aux``), under micro-batches: a micro-batch's share of such a loss is the same
linear step applied to its shares, so they add up to the batch's loss. Micro-batch plans once
refused all of them ("reduces over 'batch' and its result is used by later operators"). What is
not linear in the shares stays refused, at the plan's ``microbatch`` line: a term without the
batch added to the loss (it would be added once per micro-batch), a product of two losses.

The oracle is the plain model: one step of all ranks simulated in this process against it, in
float64 (``verify_before_launch``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from ssdsl.transform.microbatch import NotMicrobatchable

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, SEQ = 16, 8, 6
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.embed(idx))))


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(4300 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    target = data[:, 1:].clone()
    target[:3, 1:] = -100  # the first rows mostly unlabelled: micro-batches count unlike
    return (data[:, :-1],), target


def ce(o, t):
    return F.cross_entropy(o.reshape(-1, VOCAB), t.reshape(-1))


def loss(o, t):
    return {loss}
'''

ACCEPTED = {
    "scaled": "0.5 * ce(o, t)",
    "divided": "ce(o, t) / 4",
    "negated mean": "-F.log_softmax(o, -1).gather(-1, t.clamp(min=0)[..., None]).mean()",
    "plus an auxiliary mean": "ce(o, t) + 0.01 * o.pow(2).mean()",
    "a difference, halved": "(ce(o, t) - 0.1 * o.abs().sum() / o.numel()) / 2",
}
REFUSED = {
    "plus a term without the batch": "ce(o, t) + o.new_ones(())",
    "a product of losses": "ce(o, t) * o.pow(2).mean()",
    "plus a number": "ce(o, t) + 1.0",
}


def _model(tmp_path, expr: str) -> str:
    path = tmp_path / "tails.py"
    path.write_text(textwrap.dedent(MODEL).replace("{loss}", expr))
    return str(path)


@pytest.mark.parametrize("plan, params, world", [
    ("1f1b", (("microbatches", "4"),), 2),
    ("gpipe", (("microbatches", "2"),), 2),
    ("dp", (), 2),
])
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_linear_steps_after_a_batch_reduction_train_like_the_plain_model(tmp_path, name, plan,
                                                                          params, world):
    v = verify_before_launch(JobSpec(_model(tmp_path, ACCEPTED[name]), plan, params), world)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12


DP_MICROBATCHES = """plan dp_mb(dp: int = world, microbatches: int = 2)
partition all along batch into dp
use one_f_one_b(stages=1, microbatches=microbatches, width=dp)
"""


def test_data_parallel_micro_batches_of_a_scaled_loss_train_like_the_plain_model(tmp_path):
    plan = tmp_path / "dp_mb.ssp"
    plan.write_text(DP_MICROBATCHES)
    v = verify_before_launch(JobSpec(_model(tmp_path, ACCEPTED["plus an auxiliary mean"]),
                                     str(plan), (("microbatches", "2"),)), 2)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12


@pytest.mark.parametrize("name", list(REFUSED))
def test_steps_not_linear_in_the_shares_are_refused_at_the_microbatch_line(tmp_path, name):
    with pytest.raises(NotMicrobatchable) as err:
        verify_before_launch(JobSpec(_model(tmp_path, REFUSED[name]), "1f1b",
                                     (("microbatches", "2"),)), 2)
    span = err.value.span
    plan_lines = Path(span.file).read_text().splitlines()
    assert plan_lines[span.line - 1].startswith("microbatch along batch"), span
    assert "used by later operators" in str(err.value)
