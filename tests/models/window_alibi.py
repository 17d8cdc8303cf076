"""A test model that builds its attention bias the way HF Mistral and BLOOM do: a sliding-window
mask started from ``positions.new_ones(())`` (a tensor of the batch read for its dtype and
device only) and an ALiBi bias tiled over the batch with ``repeat(batch, 1, 1)``."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, WIDTH, HEADS, SEQ, WINDOW = 16, 8, 2, 6, 3
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        d = WIDTH // HEADS
        pos = torch.arange(t, device=idx.device).expand(b, t)          # (b, t), per example
        q_pos, k_pos = pos[:, None, :, None], pos[:, None, None, :]
        keep = q_pos.new_ones((), dtype=torch.bool) & (k_pos <= q_pos) & (k_pos > q_pos - WINDOW)
        slopes = 0.5 ** torch.arange(1, HEADS + 1, device=idx.device, dtype=torch.float32)
        alibi = (slopes[:, None, None] * torch.arange(t, device=idx.device)).repeat(b, 1, 1)
        x = self.embed(idx)
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / d ** 0.5 + alibi.view(b, HEADS, 1, t).to(x.dtype)
        scores = scores.masked_fill(~keep, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, WIDTH)
        return self.head(x + self.proj(y))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
