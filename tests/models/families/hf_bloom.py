"""HF BloomForCausalLM, tiny config: ALiBi position bias, fused query_key_value, embedding
layernorm, tied LM head."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import BloomConfig, BloomForCausalLM
        c = BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                        attention_dropout=0.0, hidden_dropout=0.0)
        self.lm = BloomForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(1200 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
