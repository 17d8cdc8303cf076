"""A test model whose multi-label BCE takes a ``pos_weight`` derived from the logits
(``torch.ones_like(logits[0]) * 3.0``, shape ``(classes,)``) and a class ``weight`` of shape
``(1, classes)``, both broadcast against the ``(batch, classes)`` logits inside
``binary_cross_entropy_with_logits``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES = 8, 16
BATCH_SIZE = 8


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh(), nn.Linear(FEATURES, CLASSES))


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(5200 + step)
    x = torch.randn(batch_size, FEATURES, generator=g)
    return (x,), (torch.rand(batch_size, CLASSES, generator=g) < 0.3).float()


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    pos_weight = torch.ones_like(logits[0]) * 3.0
    weight = torch.linspace(0.5, 1.5, CLASSES, dtype=logits.dtype, device=logits.device)[None, :]
    return F.binary_cross_entropy_with_logits(logits, target, weight=weight,
                                              pos_weight=pos_weight)
