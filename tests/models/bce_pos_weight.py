"""A test model whose loss weighs a multi-label BCE by a per-class ``pos_weight`` of shape
``(classes,)``, made in the loss with ``torch.full``, broadcast against the ``(batch, seq,
classes)`` logits inside ``binary_cross_entropy_with_logits``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES, SEQ = 8, 16, 4
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh(), nn.Linear(FEATURES, CLASSES))


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(5100 + step)
    x = torch.randn(batch_size, SEQ, FEATURES, generator=g)
    return (x,), (torch.rand(batch_size, SEQ, CLASSES, generator=g) < 0.3).float()


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    pos_weight = torch.full((CLASSES,), 3.0, dtype=logits.dtype, device=logits.device)
    return F.binary_cross_entropy_with_logits(logits, target, pos_weight=pos_weight)
