"""A bench-sized GPT model file: the bundled examples/gpt.py at 4 layers, width 256, seq 128.

Big enough that compute, not collective latency, sets the step time on a 2-core CPU; used by
``bench/bench_ddp.py --model bench/gpt_small.py --batch-size 16``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "ssdsl_bench_gpt_example", Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)

N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, VOCAB = 4, 8, 256, 128, 2048
BATCH_SIZE = 16
INPUT_DIMS = (("batch", "seq"),)


def build_model() -> torch.nn.Module:
    return _gpt.build_gpt(n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD, block_size=BLOCK_SIZE,
                          vocab=VOCAB)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (batch_size, BLOCK_SIZE + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)
