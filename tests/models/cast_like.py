"""A test model that casts tensors ``type_as`` / ``.to(other)`` tensors of other shapes, as HF
DeBERTa-v2 does: a 0-dim scale cast like a (seq, seq) relative-position table, and a bias of
one row cast like the (batch, seq, width) hidden states. ``other`` is read for its dtype only."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, WIDTH, SEQ = 16, 8, 6
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(torch.linspace(-1.0, 1.0, WIDTH)[None, :])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.embed(idx)                                           # (b, t, w)
        rel = torch.arange(t, device=idx.device)[:, None] - torch.arange(t, device=idx.device)
        near = (rel.abs() <= 1).to(h)                                 # (t, t) .to a (b, t, w)
        scale = h.new_full((), float(WIDTH)).sqrt().type_as(near)     # 0-dim like (t, t)
        h = torch.tanh(self.mix(h)) / scale
        h = h + self.bias.type_as(h)                                  # (1, w) like (b, t, w)
        h = h + torch.einsum("st,btw->bsw", near, h) * 0.1
        return self.head(h)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(4100 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return (data[:, :-1],), data[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
