"""A nanoGPT-style decoder: token and position embeddings, pre-layer-norm blocks with a fused QKV
projection and causal scaled-dot-product attention, a GELU MLP, residuals, and an LM head tied to
the token embedding. No dropout, so that a parallel run can be compared with a single-device one.

The data has structure a model can learn in a few steps: each sequence is a run of "words", four
tokens long, drawn at random from a fixed vocabulary of four words. Within a word the next token
is certain; at a word boundary it is one of four. The loss falls from ln(64) = 4.16 towards
ln(4) / 4 = 0.35 (about 3.2 after 4 steps, 2.8 after 20, with the plain SGD below), so a run shows
that training works.

Sizes are module constants; ``build_gpt(...)`` builds any size (the trace benchmark builds GPT-3
175B on the ``meta`` device with it).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER = 2
N_HEAD = 4
N_EMBD = 32
BLOCK_SIZE = 16
VOCAB = 64
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hd = C // self.n_head
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, *, n_layer: int, n_head: int, n_embd: int, block_size: int,
                 vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two uses
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(*, n_layer: int = N_LAYER, n_head: int = N_HEAD, n_embd: int = N_EMBD,
              block_size: int = BLOCK_SIZE, vocab: int = VOCAB) -> GPT:
    """A GPT of any size (build it under ``torch.device("meta")`` to plan a large one)."""
    return GPT(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab=vocab)


def build_model() -> nn.Module:
    return build_gpt()


# Four words of four distinct tokens each, fixed by a seed (the same in every process).
WORD_LEN = 4
WORDS = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0),
                       device="cpu")[:4 * WORD_LEN].reshape(4, WORD_LEN)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of random words (deterministic in ``step``); the target is the next token."""
    g = torch.Generator().manual_seed(1000 + step)
    n_words = (BLOCK_SIZE + 1 + WORD_LEN - 1) // WORD_LEN
    choice = torch.randint(0, len(WORDS), (batch_size, n_words), generator=g)
    data = WORDS[choice].reshape(batch_size, -1)[:, :BLOCK_SIZE + 1]
    return data[:, :-1], data[:, 1:]


def make_optimizer(params) -> torch.optim.Optimizer:
    """Plain SGD: its step is linear in the gradient, so a parallel run's float32 rounding stays
    as small in the parameters as it is in the gradients (Adam would magnify it where gradients
    are near zero)."""
    return torch.optim.SGD(params, lr=0.3)
