"""A third-party decoder: Hugging Face ``LlamaForCausalLM`` from a tiny config (no download).

Grouped-query attention (2 key/value heads for 4 query heads), rotary embeddings, RMS norm, SwiGLU.
The loss is next-token cross-entropy over the logits, computed here (not by the HF model).
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB = 64
HIDDEN = 32
LAYERS = 2
HEADS = 4
KV_HEADS = 2
SEQ = 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class CausalLM(nn.Module):
    """Returns the logits tensor only, so the model file's loss sees a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                             attention_dropout=0.0, tie_word_embeddings=False)
        config._attn_implementation = "sdpa"
        self.lm = LlamaForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits


def build_model() -> nn.Module:
    return CausalLM()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6000 + step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]
