"""A tiny model whose floating tensor without gradient crosses pipeline stages.

``cos`` is built from a buffer and the sequence positions (as the rotary tables of LLaMA-style
models are): floating, read by every block, and needing no gradient. Under a pipeline it is made
in the first stage and read by the later ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 4
SEQ = 6
WIDTH = 8
CLASSES = 5
INPUT_DIMS = (("batch", "seq", "features"),)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) * cos)


class Model(nn.Module):
    def __init__(self, n_blocks: int = 4) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)
        cos = torch.cos(pos[:, None] * self.freq[None, :])   # no gradient, read by every block
        for block in self.blocks:
            x = block(x, cos)
        return self.head(x.mean(dim=1))


def build_model() -> nn.Module:
    return Model()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(batch_size, SEQ, WIDTH, generator=g),
            torch.randint(0, CLASSES, (batch_size,), generator=g))
