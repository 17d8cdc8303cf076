"""HF GPTNeoForCausalLM, tiny config (global and local attention layers)."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import GPTNeoConfig, GPTNeoForCausalLM
        c = GPTNeoConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                         attention_types=[[["global", "local"], 1]], num_heads=HEADS,
                         intermediate_size=4 * HIDDEN, window_size=4, max_position_embeddings=SEQ,
                         embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
        self.lm = GPTNeoForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(300 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
