"""A test model with in-place activations (``nn.ReLU(inplace=True)``, timm's ``hardswish_``):
under a plan that gathers the tensor an in-place op writes, the op writes a value the rank
received."""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.Hardswish(inplace=True)
        self.fc2 = nn.Linear(8, 8)
        self.act2 = nn.ReLU(inplace=True)
        self.fc3 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act(self.fc1(x)))))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 6, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
