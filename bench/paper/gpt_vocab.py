"""A GPT with a large vocabulary (costing only, on meta): 24 layers, width 2048, 16 heads,
sequence 2048, vocabulary 256,000 (mT5/PaLM-sized); about 1.2B parameters in the blocks and
0.5B in the tied embedding and head."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import example  # noqa: E402

_gpt = example("gpt")
N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, VOCAB = 24, 16, 2048, 2048, 256_000
BATCH_SIZE = 64
INPUT_DIMS = (("batch", "seq"),)


def build_model() -> torch.nn.Module:
    return _gpt.build_gpt(n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD, block_size=BLOCK_SIZE,
                          vocab=VOCAB)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.zeros(batch_size, BLOCK_SIZE + 1, dtype=torch.long, device="meta")
    return data[:, :-1], data[:, 1:]
