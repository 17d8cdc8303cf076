"""A test model that pools one token per row as Hugging Face's sequence classifiers and CLIP's
text model do: ``h[torch.arange(batch), last]`` with ``last`` each row's last non-padding
position (computed from the tokens), then a classifier."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, WIDTH, SEQ, PAD = 16, 8, 6, 0
BATCH_SIZE = 4
INPUT_DIMS = (("batch", "seq"),)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(idx)))
        last = (idx != PAD).sum(-1) - 1
        return self.head(h[torch.arange(idx.shape[0]), last])


def build_model() -> nn.Module:
    return Classifier()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    idx = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (batch_size,), generator=g)
    idx[torch.arange(SEQ)[None, :] >= lengths[:, None]] = PAD
    return idx, torch.randint(0, 3, (batch_size,), generator=g)
