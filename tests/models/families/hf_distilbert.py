"""HF DistilBertForMaskedLM, tiny config: q/k/v/out_lin names, sinusoidal-free learned positions,
vocab projector tied to the word embeddings."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class MaskedLM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import DistilBertConfig, DistilBertForMaskedLM
        c = DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                             hidden_dim=4 * HIDDEN, max_position_embeddings=SEQ, dropout=0.0,
                             attention_dropout=0.0)
        c._attn_implementation = "sdpa"
        self.lm = DistilBertForMaskedLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx).logits

def build_model():
    return MaskedLM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(1800 + step)
    tokens = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    chosen = torch.rand(batch_size, SEQ, generator=g) < 0.15
    return torch.where(chosen, torch.zeros_like(tokens), tokens), tokens
