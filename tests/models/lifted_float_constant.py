"""A test model that makes a float tensor in forward from a Python number, as DeBERTa-v2's
relative-position buckets do (``torch.tensor((max_position - 1) / mid)``): ``torch.tensor``
gives torch's default dtype, float32, whatever the model was cast to. Under ``--dtype float64``
the lifted constant and the ``log`` computed from it alone stay float32, as on one device; the
value is read at the first block and after the last, so a pipeline sends it between stages."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.log(torch.tensor(10.0 / 3.0))  # float32: 1.2039728 (1.2039728043259361)
        h = self.inp(x) * scale
        for block in self.blocks:
            h = block(h)
        return self.head(h * scale)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)
