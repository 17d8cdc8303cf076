"""A third-party decoder: Hugging Face ``GPT2LMHeadModel`` from a tiny config (no download).

GPT-2's projections are HF ``Conv1D`` layers (``view`` -> ``addmm`` -> ``view``), its attention
projection is one fused ``c_attn`` (q, k and v side by side), and ``lm_head`` is tied to the token
embedding ``wte``. The loss is next-token cross-entropy over the logits, computed here (in the
model's dtype, not by the HF model, which casts to float32).
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB = 64
HIDDEN = 32
LAYERS = 2
HEADS = 4
SEQ = 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class CausalLM(nn.Module):
    """Returns the logits tensor only, so the model file's loss sees a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                            n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        config._attn_implementation = "sdpa"
        self.lm = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits


def build_model() -> nn.Module:
    return CausalLM()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]
