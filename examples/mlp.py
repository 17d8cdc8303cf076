"""A deep MLP classifier: linear layers with GELU between them, cross-entropy over the classes.

Sizes are module constants; every hidden size is divisible by 8, so tensor-parallel plans can
split them into 2, 4 or 8 parts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

N_LAYERS = 4
IN_DIM = 32
HIDDEN = 64
CLASSES = 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "features"),)


class MLP(nn.Module):
    def __init__(self, *, n_layers: int = N_LAYERS, in_dim: int = IN_DIM, hidden: int = HIDDEN,
                 classes: int = CLASSES) -> None:
        super().__init__()
        sizes = [in_dim] + [hidden] * (n_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.act = nn.GELU()
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.act(layer(x))
        return self.head(x)


def build_model() -> nn.Module:
    return MLP()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(batch_size, IN_DIM, generator=g)
    y = torch.randint(0, CLASSES, (batch_size,), generator=g)
    return x, y
