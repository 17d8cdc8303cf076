"""A test model that scatters within each row (``zeros.scatter_add(-1, topk indices, values)``:
keep each token's four largest features): every row writes only into itself, so the batch
splits, and a pipeline with micro-batches runs it (it was refused: no annotation for the
scatters)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)
VOCAB, WIDTH, SEQ = 40, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.fc(h)
        values, index = a.topk(4, dim=-1)
        return h + torch.zeros_like(a).scatter_add(-1, index, values)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(40 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
