"""A test model with SegFormer's Mix-FFN: a linear, the tokens laid back out as an image for a
depthwise 3x3 conv (one group per channel, with a bias), GELU, a second linear."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH, HIDDEN, SIDE = 8, 16, 4
BATCH_SIZE = 4
INPUT_DIMS = (("batch", "tokens", "width"),)


class MixFfn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.dwconv = nn.Conv2d(HIDDEN, HIDDEN, 3, padding=1, groups=HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        b, n, c = h.shape
        h = self.dwconv(h.transpose(1, 2).reshape(b, c, SIDE, SIDE)).flatten(2).transpose(1, 2)
        return self.fc2(torch.nn.functional.gelu(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.mlp = MixFfn()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head((h + self.mlp(h)).mean(1))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(800 + step)
    return (torch.randn(batch_size, SIDE * SIDE, WIDTH, generator=g),
            torch.randint(0, 3, (batch_size,), generator=g))
