"""A test model with frozen parameters (``requires_grad=False``): a position table added to the
input (Whisper's sinusoidal encoder positions are held this way) and the bias of the first
linear. Training leaves both as they were; the other parameters learn."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH, SEQ = 8, 4
BATCH_SIZE = 4
INPUT_DIMS = (("batch", "seq", "width"),)


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(SEQ, WIDTH)
        self.positions.requires_grad_(False)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.fc.bias.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.positions(torch.arange(SEQ))
        h = torch.tanh(self.fc(h))
        return self.head(h.mean(1))


def build_model() -> nn.Module:
    return Frozen()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    return torch.randn(batch_size, SEQ, WIDTH, generator=g), torch.randint(0, 3, (batch_size,),
                                                                             generator=g)
