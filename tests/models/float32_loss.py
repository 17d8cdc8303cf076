"""A test model that computes its logits' loss in float32 whatever its own dtype, as Hugging Face
causal LMs do (``logits.float()``)."""

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
        return self.out(torch.tanh(self.fc(x))).float()


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 10, (batch_size,),
                                                                    generator=g)
