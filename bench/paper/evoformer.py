"""An Evoformer stack at AlphaFold2's training scale (costing only, on meta).

48 blocks, MSA depth 128, 256 residues (the training crop), MSA channels 256, pair channels 128,
8 heads, outer-product channels 32 (AlphaFold2's Evoformer sizes; its triangle attention is not
in examples/evoformer.py, whose blocks this file reuses). Recycling is not modelled.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import example  # noqa: E402

_evo = example("evoformer", N_BLOCKS=48, N_SEQ=128, N_RES=256, C_M=256, C_Z=128, HEADS=8,
               C_OPM=32, BINS=64)
BATCH_SIZE = 32
INPUT_DIMS = _evo.INPUT_DIMS


def build_model() -> torch.nn.Module:
    return _evo.Evoformer()


def get_batch(step: int, batch_size: int):
    e = _evo
    m = torch.empty(batch_size, e.N_SEQ, e.N_RES, e.C_M, device="meta")
    z = torch.empty(batch_size, e.N_RES, e.N_RES, e.C_Z, device="meta")
    return (m, z), torch.zeros(batch_size, e.N_RES, e.N_RES, dtype=torch.long, device="meta")
