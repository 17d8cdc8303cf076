"""A test model with a one-layer ``nn.LSTM`` (``dropout=0.0``): ``aten.lstm`` is tagged as
seeded, but with dropout 0 (and one layer) it draws no random numbers."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, SEQ = 32, 16, 8
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH, batch_first=True, dropout=0.0)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(idx))[0])


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(5300 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return (data[:, :-1],), data[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
