"""A test model that builds a per-example mask the way Hugging Face mask builders do: a
per-batch table indexed by ``arange(batch_size)[:, None, None]`` and a position index."""

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
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        table = (idx % 3).cumsum(-1)                                  # (b, t), per example
        rows = torch.arange(b, device=idx.device)[:, None, None]
        q_pos, k_pos = torch.arange(t, device=idx.device)[None, :, None], torch.arange(t, device=idx.device)[None, None, :]
        allowed = table[rows, q_pos] >= table[rows, k_pos]            # (b, t, t)
        x = self.embed(idx)
        scores = (allowed.to(x.dtype) - 1) * 1e9 + 0.1 * torch.arange(t, device=idx.device).to(x.dtype)
        return self.head(scores.softmax(-1) @ x)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]
