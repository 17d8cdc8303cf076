"""HF FalconForCausalLM, tiny config: multi-query attention from one fused query_key_value
(new decoder architecture off: the 7B layout), parallel attention and MLP from one
layernorm, rotary positions, tied LM head."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import FalconConfig, FalconForCausalLM
        c = FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, multi_query=True, parallel_attn=True,
                         new_decoder_architecture=False, alibi=False, bias=False,
                         max_position_embeddings=SEQ, attention_dropout=0.0,
                         hidden_dropout=0.0)
        c._attn_implementation = "sdpa"
        self.lm = FalconForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2100 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
