"""A test model that keeps a table in float32 whatever its own dtype and reads it in a later
block, as rotary embeddings do (Hugging Face LLaMA computes ``cos``/``sin`` in float32 once and
every layer reads them): under ``--dtype float64`` a pipeline sends a float32 tensor between
stages among float64 ones."""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * table.to(x.dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.out = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.sigmoid(self.scale(x).float())  # float32, as rotary tables are
        for block in self.blocks:
            x = block(x, table)
        return self.out(x)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 10, (batch_size,),
                                                                    generator=g)
