"""Batch splits of code as libraries write it (issue 16): a global average pool before the
classifier, decoder inputs made by shifting the labels right into ``new_zeros``, and a
convolution split by the words a linear layer takes (``out``/``in``).

Oracle: the plain single-device model in float64 (``compare_with_model``), for one step of every
rank simulated in one process from the lowered programs: ``dp`` on 2 devices and ``1f1b`` with 2
stages and 4 micro-batches. A per-example pool needs no all-gather under ``dp``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_file, elaborate_text
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.runtime.verify import compare_with_model, simulate_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

F64 = torch.float64

POOLED_CNN = '''
import torch, torch.nn as nn, torch.nn.functional as F
BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 3, 6, 6, generator=g), torch.randint(0, 5, (batch_size,),
                                                                        generator=g)
'''

SHIFTED = '''
import torch, torch.nn as nn, torch.nn.functional as F
V, C, T = 10, 8, 6
BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.src = nn.Embedding(V, C)
        self.dec = nn.Embedding(V, C)
        self.head = nn.Linear(C, V)

    def forward(self, x, labels):
        # decoder inputs: the labels shifted right, a start token first, -100 replaced
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 1
        shifted.masked_fill_(shifted == -100, 0)
        h = torch.tanh(self.src(x) + self.dec(shifted))
        return self.head(h)


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, V, (batch_size, T), generator=g)
    y = torch.randint(0, V, (batch_size, T), generator=g)
    y = torch.where(torch.rand(batch_size, T, generator=g) < 0.3, torch.full_like(y, -100), y)
    return (x, y), y


def loss(o, t):
    return F.cross_entropy(o.flatten(0, 1), t.flatten())
'''

ONE_F_ONE_B = ("plan p()\nmicrobatch along batch into 4\nstages into 2 as st\n"
               "assign st[0] to device 0\nassign st[1] to device 1\n"
               "order on device 0: forward st[0] mb 0..1, interleave(forward st[0] mb 1..4, "
               "backward st[0] mb 0..3), backward st[0] mb 3..4\n"
               "order on device 1: interleave(forward st[1] mb 0..4, backward st[1] mb 0..4)\n")


def _check(path: Path, plan: str, world: int):
    mf = load_model_file(str(path))
    graph = trace(mf, device="cpu")
    elaborated = elaborate_file(plan, world=world) if "\n" not in plan else \
        elaborate_text(plan, world=world)
    t, lowered = schedule_plan(graph, elaborated)
    m = materialize(t, dtype=F64, schedule=lowered)
    sim = simulate_plan(m, mf)
    problems, ref_loss, worst = compare_with_model(m, mf, sim)
    assert not problems, problems
    assert sim.loss == pytest.approx(ref_loss, rel=1e-12)
    assert worst < 1e-12
    return m


def _kinds(m) -> set[str]:
    return {k for e in m.edges.values()
            for k in (*e.adapter.kinds, *(e.adapter.backward.kinds if e.adapter.backward else ()))}


@pytest.mark.parametrize("source", ["pooled", "shifted"])
@pytest.mark.parametrize("plan, world", [("dp", 2), (ONE_F_ONE_B, 2)], ids=["dp-2", "1f1b-2x4"])
def test_library_code_splits_along_the_batch(tmp_path, source, plan, world):
    path = tmp_path / f"{source}.py"
    path.write_text(POOLED_CNN if source == "pooled" else SHIFTED)
    m = _check(path, plan, world)
    if plan == "dp":
        # every example is pooled (and shifted) on its own: nothing crosses devices but the
        # weight gradients
        assert m.accounting()["forward"] == {} and "all_gather" not in _kinds(m)


@pytest.mark.parametrize("word", ["out", "in"])
def test_convolutions_take_the_linear_words(tmp_path, word):
    path = tmp_path / "pooled.py"
    path.write_text(POOLED_CNN)
    plan = (f"plan p()\npartition conv2 along {word} into 2\nreplicate rest into 2\n"
            "assign each part i to device i\n")
    m = _check(path, plan, 2)
    if word == "in":  # input channels are summed: the partial outputs are all-reduced
        assert "all_reduce" in m.accounting()["forward"]
