"""A small Swin-style vision transformer: patch-embedding convolution, window attention with a
relative position bias, shifted windows (``roll`` plus a mask), patch merging, mean pooling.

Window partition and merge are ``view``/``permute``, so the batch dim flows through the merged
``(batch windows)`` dim of window attention.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IMG = 16
PATCH = 2
IN_CH = 3
EMBED = 16
DEPTHS = (2, 2)
HEADS = (4, 8)
WINDOW = 4
CLASSES = 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)


def window_partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, C)


def window_merge(w: torch.Tensor, ws: int, B: int, H: int, W: int) -> torch.Tensor:
    C = w.shape[-1]
    x = w.view(B, H // ws, W // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def _relative_index(ws: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    flat = coords.flatten(1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0) + (ws - 1)
    return rel[..., 0] * (2 * ws - 1) + rel[..., 1]


def _shift_mask(H: int, W: int, ws: int, shift: int) -> torch.Tensor:
    img = torch.zeros(1, H, W, 1)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    win = window_partition(img, ws).squeeze(-1)
    diff = win[:, None, :] - win[:, :, None]
    return torch.where(diff != 0, -100.0, 0.0)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, ws: int) -> None:
        super().__init__()
        self.heads, self.ws = heads, ws
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads) * 0.02)
        self.register_buffer("rel_index", _relative_index(ws), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        Bw, N, C = x.shape
        qkv = self.qkv(x).reshape(Bw, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.bias_table[self.rel_index.view(-1)].view(N, N, self.heads).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(Bw // nW, nW, self.heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(Bw, self.heads, N, N)
        attn = attn.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(Bw, N, C)
        return self.proj(y)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, res: int, ws: int, shift: int) -> None:
        super().__init__()
        self.res, self.ws, self.shift = res, min(ws, res), shift if res > ws else 0
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, self.ws)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        if self.shift:
            self.register_buffer("attn_mask", _shift_mask(res, res, self.ws, self.shift),
                                 persistent=False)
        else:
            self.attn_mask = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        H = W = self.res
        h = self.norm1(x).view(B, H, W, C)
        if self.shift:
            h = torch.roll(h, shifts=(-self.shift, -self.shift), dims=(1, 2))
        h = window_merge(self.attn(window_partition(h, self.ws), self.attn_mask), self.ws, B, H, W)
        if self.shift:
            h = torch.roll(h, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + h.reshape(B, L, C)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int, res: int) -> None:
        super().__init__()
        self.res = res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        x = x.view(B, self.res, self.res, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.reshape(B, -1, 4 * C)))


class Swin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(IN_CH, EMBED, kernel_size=PATCH, stride=PATCH)
        res, dim = IMG // PATCH, EMBED
        self.stages = nn.ModuleList()
        for i, (depth, heads) in enumerate(zip(DEPTHS, HEADS)):
            blocks = [SwinBlock(dim, heads, res, WINDOW, 0 if j % 2 == 0 else WINDOW // 2)
                      for j in range(depth)]
            stage = nn.Sequential(*blocks)
            if i < len(DEPTHS) - 1:
                stage.append(PatchMerging(dim, res))
                res, dim = res // 2, dim * 2
            self.stages.append(stage)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(img).flatten(2).transpose(1, 2)
        for stage in self.stages:
            x = stage(x)
        return self.head(self.norm(x).mean(dim=1))


def build_model() -> nn.Module:
    return Swin()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return (torch.randn(batch_size, IN_CH, IMG, IMG, generator=g),
            torch.randint(0, CLASSES, (batch_size,), generator=g))


__all__ = ["build_model", "get_batch", "F"]
