"""HF GPTNeoXForCausalLM, tiny config: fused qkv (interleaved per head), rotary on a quarter of
each head, parallel attention + MLP residual, untied embed_out."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        c = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          max_position_embeddings=SEQ, rotary_pct=0.25,
                          use_parallel_residual=True, attention_dropout=0.0,
                          hidden_dropout=0.0)
        c._attn_implementation = "sdpa"
        self.lm = GPTNeoXForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(1100 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
