"""A test model whose forward counts its calls in a buffer (``self.calls += 1``, as a batch norm
counts ``num_batches_tracked``): once a step on one device. Micro-batches would run the forward,
and the update, once per micro-batch, so a plan with micro-batches is refused at its
``microbatch`` line; without them the counter trains like the plain model's."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(820 + step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
