"""A test model with a ``get_batch_shard`` hook and a cross-entropy loss: the loss divides by the
count of labelled targets over the whole batch (a step value), so every rank calls ``get_batch``
instead of the hook (docs/model_file.md), and the check of the hook before launch has nothing to
check. Before, that check tried to place the count's 0-d input in the batch's rows and crashed."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))


def get_batch(step: int, batch_size: int):
    return get_batch_shard(step, batch_size, 0, batch_size)


def get_batch_shard(step: int, batch_size: int, start: int, stop: int):
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(batch_size, 12, generator=g)
    y = torch.randint(0, 5, (batch_size,), generator=g)
    y[::3] = -100  # unlabelled rows: the count differs from the batch size
    return x[start:stop], y[start:stop]


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, ignore_index=-100)
