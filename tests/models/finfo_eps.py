"""A test model whose arithmetic depends on its dtype beyond rounding: it normalises with
``torch.finfo(x.dtype).eps``, which a float32 trace records as float32's epsilon (1.2e-7) while
the same model built in float64 adds float64's (2.2e-16)."""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        h = h / (h.norm(dim=-1, keepdim=True) * 1e-6 + torch.finfo(h.dtype).eps)
        return self.out(h)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(910 + step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 10, (batch_size,),
                                                                    generator=g)
