"""HF StableLmForCausalLM, tiny config: LayerNorm with bias, partial rotary (a quarter of each
head), qkv biases, SwiGLU MLP."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, KV, SEQ = 64, 32, 2, 4, 2, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import StableLmConfig, StableLmForCausalLM
        c = StableLmConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           num_key_value_heads=KV, max_position_embeddings=SEQ,
                           partial_rotary_factor=0.25, use_qkv_bias=True,
                           attention_dropout=0.0, hidden_dropout=0.0)
        c._attn_implementation = "sdpa"
        self.lm = StableLmForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2500 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
