"""An MLP with dropout in training: a random operator each rank would draw differently."""

import torch
import torch.nn as nn

BATCH_SIZE = 4


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
