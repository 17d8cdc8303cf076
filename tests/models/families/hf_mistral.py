"""HF MistralForCausalLM, tiny config: GQA, sliding-window attention shorter than the sequence."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, KV, SEQ, WINDOW = 64, 32, 2, 4, 2, 16, 6
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import MistralConfig, MistralForCausalLM
        c = MistralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=KV, max_position_embeddings=SEQ,
                          sliding_window=WINDOW, attention_dropout=0.0)
        c._attn_implementation = "sdpa"
        self.lm = MistralForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(1400 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
