"""A test model with shared weights: ``first`` and ``second`` are two Linear modules tied to one
weight (each keeps its own bias), and ``shared`` is one Linear applied twice (ALBERT-style), so a
plan can lay one weight out differently for each use."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 8
BATCH_SIZE = 4


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.second.weight = self.first.weight
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.second(h))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


def build_model() -> nn.Module:
    return Shared()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(batch_size, WIDTH, generator=g), torch.randint(0, 4, (batch_size,),
                                                                       generator=g)
