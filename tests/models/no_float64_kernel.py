"""A test model whose eager forward has no float64 kernel on the CPU (as transformers' MoE
``grouped_mm`` has none), while its traced graph runs in float64: the --check reference cannot
train it in float64."""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eager = not torch.compiler.is_exporting() and x.device.type != "meta"
        if eager and x.dtype == torch.float64:
            raise RuntimeError("no float64 kernel for this operator")
        return self.fc(x)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 6, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
