"""A test model for compiled programs: its forward casts an activation to its head's weight
dtype (``.to(self.out.weight.dtype)``, a common guard), and its loss weighs the classes by a
tensor made at module level and moved to the output's device and dtype (as ssdsl's own hint for
a tensor the loss creates says). A program compiled from a float32 trace would cast to float32
in a float64 run, and a meta trace would leave the class weights on the meta device."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8
CLASS_WEIGHTS = torch.linspace(0.5, 2.0, 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)).to(self.out.weight.dtype))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(60 + step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 3, (batch_size,), generator=g)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target,
                           weight=CLASS_WEIGHTS.to(device=output.device, dtype=output.dtype))
