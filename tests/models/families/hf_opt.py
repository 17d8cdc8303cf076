"""HF OPTForCausalLM, tiny config."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import OPTConfig, OPTForCausalLM
        c = OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                      ffn_dim=4 * HIDDEN, num_attention_heads=HEADS, max_position_embeddings=SEQ,
                      word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0, layerdrop=0.0, pad_token_id=1)
        c._attn_implementation = "sdpa"
        self.lm = OPTForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(100 + step)
    d = torch.randint(2, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
