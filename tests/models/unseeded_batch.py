"""A model file whose get_batch draws from the global generator: two calls differ."""

import torch
import torch.nn as nn

BATCH_SIZE = 4


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def get_batch(step: int, batch_size: int):
    return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))
