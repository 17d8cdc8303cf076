"""Swin Transformer at the scale of the SuperScaler paper's experiments (costing only, on meta).

A SwinV2-G-like configuration chosen here (the paper's exact table is not reproduced): embed 512,
depths 2-2-26-2, heads 16-32-64-128, 1536 x 1536 images, patch 4, window 24; about 1.8B
parameters. The batch is made on the meta device: this file is for ``ssdsl cost`` and
``bench/bench_cost_paper.py``; examples/swin.py is the runnable one. Plans name the blocks as
``--set blocks=stages.*.* --set attn_out=attn.proj --set mlp_out=mlp.2``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import example  # noqa: E402

_swin = example("swin", IMG=1536, PATCH=4, IN_CH=3, EMBED=512, DEPTHS=(2, 2, 26, 2),
                HEADS=(16, 32, 64, 128), WINDOW=24, CLASSES=1000)
BATCH_SIZE = 32
INPUT_DIMS = _swin.INPUT_DIMS


def build_model() -> torch.nn.Module:
    return _swin.Swin()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(batch_size, 3, _swin.IMG, _swin.IMG, device="meta"),
            torch.zeros(batch_size, dtype=torch.long, device="meta"))
