"""The Evoformer stack with AlphaFold2 recycling at AlphaFold2's block size (costing only, on
meta): examples/evoformer_recycle.py's model, three passes of the trunk per step, the first two
detached, with bench/paper/evoformer.py's sizes (MSA depth 128, 256 residues, MSA channels 256,
pair channels 128, 8 heads, outer-product channels 32).

The trunk is 8 blocks deep instead of AlphaFold2's 48, to keep planning under a few minutes on
the project's 2-core machine (three passes make 3x the operators): a block's cost is the same,
and a pipeline's bubble depends on stages and micro-batches, not on how many blocks a stage has,
so step time scales with the depth (x6 for 48 blocks) at the same bubble.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import example  # noqa: E402

SIZES = dict(N_SEQ=128, N_RES=256, C_M=256, C_Z=128, HEADS=8, C_OPM=32, BINS=64)
_rec = example("evoformer_recycle", N_BLOCKS=8)
for _k, _v in SIZES.items():  # the blocks read the sizes from the module they are defined in
    setattr(_rec.evo, _k, _v)
BATCH_SIZE = 16
INPUT_DIMS = _rec.INPUT_DIMS


def build_model() -> torch.nn.Module:
    return _rec.RecyclingEvoformer()


def get_batch(step: int, batch_size: int):
    e = _rec.evo
    m = torch.empty(batch_size, e.N_SEQ, e.N_RES, e.C_M, device="meta")
    z = torch.empty(batch_size, e.N_RES, e.N_RES, e.C_Z, device="meta")
    return (m, z), torch.zeros(batch_size, e.N_RES, e.N_RES, dtype=torch.long, device="meta")
