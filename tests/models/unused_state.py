"""A test model with state its forward never reads: a submodule it does not call and a
persistent buffer kept for bookkeeping. The traced step holds no shard of them, yet the model's
``state_dict`` has them, so a saved or merged state must carry them (as built: training leaves
them alone) for ``load_state_dict`` to be strict."""

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
        self.spare = nn.Linear(4, 4)  # never called
        self.register_buffer("version", torch.tensor(3))  # persistent, never read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(930 + step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
