"""A test model that makes a float32 tensor from constants alone, as OPT's attention mask is
``torch.ones(batch, seq)`` whatever the model's dtype: positions are the mask's cumulative sum,
cast to integers. Nothing trained passes through float32, so a float64 run is judged in float64."""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 8)
        self.pos = nn.Embedding(8, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(idx.shape, dtype=torch.float32, device=idx.device)
        positions = (mask.cumsum(1) - 1).long()
        return self.out(self.tok(idx) + self.pos(positions))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(710 + step)
    data = torch.randint(0, 16, (batch_size, 9), generator=g)
    return data[:, :-1], data[:, 1:]
