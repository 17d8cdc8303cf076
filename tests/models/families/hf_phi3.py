"""HF Phi3ForCausalLM, tiny config: one fused qkv_proj (GQA: 4 query, 2 key/value heads) and
one fused gate_up_proj split by chunk, RMSNorm, rotary positions."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, KV, SEQ = 64, 32, 2, 4, 2, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import Phi3Config, Phi3ForCausalLM
        c = Phi3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV, max_position_embeddings=SEQ,
                       original_max_position_embeddings=SEQ, attention_dropout=0.0,
                       resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, sliding_window=None)
        c._attn_implementation = "sdpa"
        self.lm = Phi3ForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2400 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
