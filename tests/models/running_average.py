"""A test model that keeps a running average of an activation in a buffer, written as ssdsl's
hint for a ``with torch.no_grad():`` block says: from a detached tensor, no ``with``
(tests/models_bad/forward_no_grad_block.py is the same model with the block). The buffer and the
training equal the plain model's (which runs this very forward)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return self.out(h)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
