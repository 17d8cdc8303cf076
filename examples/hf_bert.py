"""A third-party encoder: Hugging Face ``BertForMaskedLM`` from a tiny config (no download).

Post-norm encoder blocks (``attention.self.{query,key,value}``, ``attention.output.dense``,
``intermediate.dense``, ``output.dense``), an MLM head tied to the word embeddings. The batch is
token ids with a random 15% of positions replaced by the mask token (0); the model predicts
every original token (the default cross-entropy over all positions, so every batch element
weighs the same whatever its masked count).
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


class MaskedLM(nn.Module):
    """Returns the logits tensor only, so the model file's loss sees a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
                            max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        config._attn_implementation = "sdpa"
        self.lm = BertForMaskedLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits


def build_model() -> nn.Module:
    return MaskedLM()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8000 + step)
    tokens = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    chosen = torch.rand(batch_size, SEQ, generator=g) < 0.15
    inputs = torch.where(chosen, torch.zeros_like(tokens), tokens)  # 0 is the mask token here
    return inputs, tokens
