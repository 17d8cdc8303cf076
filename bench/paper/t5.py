"""A T5-like encoder-decoder (costing only, on meta): 24 encoder and 24 decoder layers of width
1024, feed-forward 16384, 32 heads of 128 (T5-3B's shape), vocabulary 32,128, input and target
sequences of 512; pre-layer-norm blocks, learned positions instead of T5's relative bias.

The layers are one list ``h`` (encoder first): megatron_tp's default names (``attn``,
``attn.c_proj``, ``mlp``, ``mlp.c_proj``) split them; a decoder layer's cross-attention
(``xattn``) reads the encoder's output, a skip edge for pipelines.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

N_ENC, N_DEC, D, D_FF, HEADS, VOCAB, SEQ = 24, 24, 1024, 16384, 32, 32128, 512
BATCH_SIZE = 64
INPUT_DIMS = (("batch", "seq"), ("batch", "seq"))


class Attention(nn.Module):
    def __init__(self, *, causal: bool, cross: bool) -> None:
        super().__init__()
        self.causal, self.cross = causal, cross
        self.c_attn = nn.Linear(D, D if cross else 3 * D, bias=False)
        self.kv = nn.Linear(D, 2 * D, bias=False) if cross else None
        self.c_proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        if self.cross:
            q = self.c_attn(x)
            k, v = self.kv(memory).split(D, dim=2)
        else:
            q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (t.view(B, -1, HEADS, D // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(D, D_FF, bias=False)
        self.c_proj = nn.Linear(D_FF, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)))


class Layer(nn.Module):
    def __init__(self, *, decoder: bool) -> None:
        super().__init__()
        self.decoder = decoder
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(causal=decoder, cross=False)
        if decoder:
            self.ln_x = nn.LayerNorm(D)
            self.xattn = Attention(causal=False, cross=True)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        if self.decoder:
            x = x + self.xattn(self.ln_x(x), memory)
        return x + self.mlp(self.ln_2(x))


class T5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.h = nn.ModuleList([Layer(decoder=False) for _ in range(N_ENC)]
                               + [Layer(decoder=True) for _ in range(N_DEC)])
        self.ln_enc, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(SEQ, device=src.device))
        x = self.shared(src) + pos
        for layer in self.h[:N_ENC]:
            x = layer(x, None)
        memory = self.ln_enc(x)
        y = self.shared(tgt) + pos
        for layer in self.h[N_ENC:]:
            y = layer(y, memory)
        return self.lm_head(self.ln_f(y))


def build_model() -> nn.Module:
    return T5()


def get_batch(step: int, batch_size: int):
    src = torch.zeros(batch_size, SEQ, dtype=torch.long, device="meta")
    tgt = torch.zeros(batch_size, SEQ + 1, dtype=torch.long, device="meta")
    return (src, tgt[:, :-1]), tgt[:, 1:]
