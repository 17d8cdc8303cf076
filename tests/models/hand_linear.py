"""A test model whose linears are written by hand, as Falcon's are: ``x @ self.weight.T`` (an
``aten.numpy_T`` then a ``matmul``), with and without a bias, in a GELU MLP."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH, HIDDEN, SEQ = 8, 16, 4
BATCH_SIZE = 4
INPUT_DIMS = (("batch", "seq", "width"),)


class HandLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(n_out) / 10) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = HandLinear(WIDTH, HIDDEN, bias=False)
        self.down = HandLinear(HIDDEN, WIDTH, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.mlp = Mlp()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head((h + self.mlp(h)).mean(1))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(batch_size, SEQ, WIDTH, generator=g), torch.randint(0, 3, (batch_size,),
                                                                             generator=g)
