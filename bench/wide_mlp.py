"""A wide MLP for memory benchmarks: blocks of Linear(D, 4D), GELU, Linear(4D, D).

``WIDE_MLP_D`` and ``WIDE_MLP_BLOCKS`` (environment) set the size; by default 16 blocks of
D = 1024 (8.4M parameters each, 537 MB of float32 parameters in all).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

D = int(os.environ.get("WIDE_MLP_D", "1024"))
BLOCKS = int(os.environ.get("WIDE_MLP_BLOCKS", "16"))
CLASSES = 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "features"),)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build_model() -> nn.Module:
    return WideMLP()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, D, generator=g), torch.randint(0, CLASSES, (batch_size,),
                                                                   generator=g)
