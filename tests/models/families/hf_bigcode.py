"""HF GPTBigCodeForCausalLM, tiny config: multi-query attention (one fused c_attn giving
HEADS query heads and one shared key/value head), learned positions, GPT-2 style blocks."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
        c = GPTBigCodeConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                             n_positions=SEQ, multi_query=True, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0)
        c._attn_implementation = "sdpa"
        self.lm = GPTBigCodeForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2200 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
