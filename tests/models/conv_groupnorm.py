"""A test model: a residual-free ResNet-style block, convolution -> GroupNorm -> ReLU ->
convolution, then a global pool and a linear head (timm ResNet with ``norm_layer=GroupNorm``)."""

from __future__ import annotations

import torch
import torch.nn as nn

BATCH_SIZE = 4
INPUT_DIMS = (("batch", "channels", "height", "width"),)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(4, 16)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.act1(self.bn1(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(720 + step)
    return torch.randn(batch_size, 3, 6, 6, generator=g), torch.randint(0, 5, (batch_size,),
                                                                          generator=g)
