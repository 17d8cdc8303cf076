"""A test model whose own optimizer has parameter groups, as most training recipes do: AdamW with
weight decay and one rate for the matrices, no decay and another rate for biases and norms
(``p.dim() < 2``). Under ZeRO the optimizer steps chunks of flat buckets, which must stay in the
groups their weights are in (before, every chunk being 1-d, all went to the no-decay group)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 24),
                         nn.Tanh(), nn.Linear(24, 5))


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(470 + step)
    return torch.randn(batch_size, 12, generator=g), torch.randint(0, 5, (batch_size,), generator=g)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def make_optimizer(params):
    params = list(params)
    return torch.optim.AdamW([
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1, "lr": 3e-3},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-2},
    ], betas=(0.8, 0.95))
