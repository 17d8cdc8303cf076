"""HF GPTJForCausalLM, tiny config: attention and MLP in parallel off one layernorm, rotary on
part of each head applied to interleaved pairs, untied LM head with bias."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, ROT, SEQ = 64, 32, 2, 4, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import GPTJConfig, GPTJForCausalLM
        c = GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                       rotary_dim=ROT, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.lm = GPTJForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(1600 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
