"""A small AlphaFold2-Evoformer-style stack: MSA row attention with pair bias and gating, MSA
column attention, MSA transition, outer-product mean, triangle multiplication (outgoing and
incoming), pair transition; a distogram head with cross-entropy over distance bins.

Inputs are an MSA representation ``(batch, seqs, res, C_m)`` and a pair representation
``(batch, res_i, res_j, C_z)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

N_BLOCKS = 2
N_SEQ = 4
N_RES = 8
C_M = 16
C_Z = 8
HEADS = 2
C_OPM = 4
BINS = 8
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seqs", "res"), ("batch", "res_i", "res_j"))


class GatedAttention(nn.Module):
    """Attention over dim -2 of ``(B, S, R, C)`` with gating and an optional pair bias."""

    def __init__(self, c: int, heads: int, c_z: int | None) -> None:
        super().__init__()
        self.heads, self.d = heads, c // heads
        self.norm = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c, bias=False)
        self.gate = nn.Linear(c, c)
        self.out = nn.Linear(c, c)
        if c_z is not None:
            self.norm_z = nn.LayerNorm(c_z)
            self.bias = nn.Linear(c_z, heads, bias=False)

    def forward(self, m: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        B, S, R, C = m.shape
        m = self.norm(m)
        q, k, v = self.qkv(m).view(B, S, R, 3, self.heads, self.d).unbind(3)
        logits = torch.einsum("bsihd,bsjhd->bshij", q, k) * self.d ** -0.5
        if z is not None:
            logits = logits + self.bias(self.norm_z(z)).permute(0, 3, 1, 2).unsqueeze(1)
        o = torch.einsum("bshij,bsjhd->bsihd", logits.softmax(-1), v).reshape(B, S, R, C)
        return self.out(torch.sigmoid(self.gate(m)) * o)


class Transition(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


class OuterProductMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(C_M)
        self.a, self.b = nn.Linear(C_M, C_OPM), nn.Linear(C_M, C_OPM)
        self.out = nn.Linear(C_OPM * C_OPM, C_Z)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        B, S, R, _ = m.shape
        m = self.norm(m)
        o = torch.einsum("bsic,bsjd->bijcd", self.a(m), self.b(m)) / S
        return self.out(o.reshape(B, R, R, C_OPM * C_OPM))


class TriangleMultiplication(nn.Module):
    def __init__(self, outgoing: bool) -> None:
        super().__init__()
        self.eq = "bikc,bjkc->bijc" if outgoing else "bkic,bkjc->bijc"
        self.norm_in, self.norm_out = nn.LayerNorm(C_Z), nn.LayerNorm(C_Z)
        self.a_gate, self.a = nn.Linear(C_Z, C_Z), nn.Linear(C_Z, C_Z)
        self.b_gate, self.b = nn.Linear(C_Z, C_Z), nn.Linear(C_Z, C_Z)
        self.gate, self.out = nn.Linear(C_Z, C_Z), nn.Linear(C_Z, C_Z)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.norm_in(z)
        a = torch.sigmoid(self.a_gate(z)) * self.a(z)
        b = torch.sigmoid(self.b_gate(z)) * self.b(z)
        x = self.norm_out(torch.einsum(self.eq, a, b))
        return torch.sigmoid(self.gate(z)) * self.out(x)


class EvoformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.row_attn = GatedAttention(C_M, HEADS, C_Z)
        self.col_attn = GatedAttention(C_M, HEADS, None)
        self.msa_transition = Transition(C_M)
        self.opm = OuterProductMean()
        self.tri_out = TriangleMultiplication(outgoing=True)
        self.tri_in = TriangleMultiplication(outgoing=False)
        self.pair_transition = Transition(C_Z)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = m + self.row_attn(m, z)
        m = m + self.col_attn(m.transpose(1, 2), None).transpose(1, 2)
        m = m + self.msa_transition(m)
        z = z + self.opm(m)
        z = z + self.tri_out(z)
        z = z + self.tri_in(z)
        return m, z + self.pair_transition(z)


class Evoformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EvoformerBlock() for _ in range(N_BLOCKS))
        self.distogram = nn.Linear(C_Z, BINS)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            m, z = block(m, z)
        return self.distogram(z)


def build_model() -> nn.Module:
    return Evoformer()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(4000 + step)
    m = torch.randn(batch_size, N_SEQ, N_RES, C_M, generator=g)
    z = torch.randn(batch_size, N_RES, N_RES, C_Z, generator=g)
    return (m, z), torch.randint(0, BINS, (batch_size, N_RES, N_RES), generator=g)
