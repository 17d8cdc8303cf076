"""A test model with the RMSNorm Hugging Face's Llama, Mistral and Qwen write by hand:
``x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps) * weight``. Its ``add`` of ``eps`` has the
hidden dim too, kept at size 1 by the mean, so a plan that splits the norm along the hidden dim
selects an operator with nothing of that dim to split."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 4
INPUT_DIMS = (("batch", "seq"),)
WIDTH, VOCAB, SEQ = 16, 32, 8


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(520 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
