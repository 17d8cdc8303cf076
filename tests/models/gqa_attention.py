"""A test model with grouped-query attention written as Hugging Face's Llama and Mistral write it:
4 query heads share 2 key/value heads, whose keys and values ``repeat_kv`` repeats (expand, then
reshape) before the attention. The query projection's heads are 2 key/value groups of 2 query
heads each (``heads`` and ``heads_1`` in ``ssdsl trace``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 4
INPUT_DIMS = (("batch", "seq"),)
WIDTH, HEADS, KV, SEQ, VOCAB = 32, 4, 2, 8, 40
HEAD_DIM = WIDTH // HEADS


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(WIDTH, KV * HEAD_DIM)
        self.v_proj = nn.Linear(WIDTH, KV * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, KV, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, KV, HEAD_DIM).transpose(1, 2)
        k, v = repeat_kv(k, HEADS // KV), repeat_kv(v, HEADS // KV)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.self_attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(610 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
