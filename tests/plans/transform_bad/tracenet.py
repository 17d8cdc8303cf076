"""A tiny model with an operator that has no annotation (``trace``), for the transform corpus."""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 4
INPUT_DIMS = (("batch", "features"),)


class TraceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h * torch.trace(h[:, :4]))


def build_model() -> nn.Module:
    return TraceNet()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
