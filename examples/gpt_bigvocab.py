"""examples/gpt.py's decoder with a large vocabulary: the embedding and the tied LM head hold
most of the weights and the head most of the work, the case of SuperScaler's interlaced
pipeline (stdlib ``interlaced_1f1b``: embedding and head tensor-parallel over all devices, the
blocks a 1F1B pipeline). 4 blocks of width 32 against a 2,048-token vocabulary: the embedding
is 65,536 of the model's 116,928 weights, and the head's matmul is 16 times the larger of a
block's MLP linears.

The data is gpt.py's (runs of four-token words; here the words are drawn from the large
vocabulary), so the loss falls from ln(2048) = 7.6 as training goes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

_spec = importlib.util.spec_from_file_location("_ssdsl_example_gpt",
                                               Path(__file__).with_name("gpt.py"))
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

N_LAYER = 4
N_HEAD = gpt.N_HEAD
N_EMBD = gpt.N_EMBD
BLOCK_SIZE = gpt.BLOCK_SIZE
VOCAB = 2048
BATCH_SIZE = gpt.BATCH_SIZE
INPUT_DIMS = gpt.INPUT_DIMS


def build_model() -> nn.Module:
    return gpt.build_gpt(n_layer=N_LAYER, vocab=VOCAB)


# gpt.py's words, drawn from the large vocabulary: its private copy (loaded above) makes its
# batches from these
WORD_LEN = gpt.WORD_LEN
WORDS = gpt.WORDS = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0),
                                   device="cpu")[:4 * WORD_LEN].reshape(4, WORD_LEN)
get_batch = gpt.get_batch
make_optimizer = gpt.make_optimizer
