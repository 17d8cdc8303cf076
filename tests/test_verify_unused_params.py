"""A parameter the loss never reaches (an HF pooler whose output the loss does not read): the
plain model leaves its ``.grad`` None, and verification before launch once failed with
``KeyError: 'no reference gradient for ...'`` (the job then ran NOT verified). Its expected
gradient is zero. Oracle: the plain model, one step of all ranks simulated in float64."""

from __future__ import annotations

import textwrap

import pytest

from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 10)
        self.pooler = nn.Linear(10, 10)  # computed, never read by the loss (as HF's poolers)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        self.pooled = torch.tanh(self.pooler(h[:, 0:1].expand(-1, 10)))
        return h


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(4500 + step)
    return (torch.randn(batch_size, 6, generator=g),), torch.randint(0, 10, (batch_size,),
                                                                     generator=g)


def loss(out, target):
    return F.cross_entropy(out, target)
'''


@pytest.mark.parametrize("plan, params", [("dp", ()), ("1f1b", (("microbatches", "2"),))])
def test_a_parameter_the_loss_does_not_reach_is_verified(tmp_path, plan, params):
    path = tmp_path / "pooled.py"
    path.write_text(textwrap.dedent(MODEL))
    v = verify_before_launch(JobSpec(str(path), plan, params), 2)
    assert v.verified and v.dtype == "float64", v
    assert abs(v.loss - v.reference_loss) <= 1e-12 * abs(v.reference_loss)
    assert v.max_grad_error < 1e-12
