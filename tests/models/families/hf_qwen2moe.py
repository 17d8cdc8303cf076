"""HF Qwen2MoeForCausalLM, tiny config: sparse MoE (top-2 of 4 experts, data-dependent
routing) plus a shared expert gated by a sigmoid, GQA."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, KV, SEQ, EXPERTS = 64, 32, 2, 4, 2, 16, 4
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
        c = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                           moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           num_key_value_heads=KV, max_position_embeddings=SEQ,
                           num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1,
                           attention_dropout=0.0, router_aux_loss_coef=0.0)
        c._attn_implementation = "sdpa"
        self.lm = Qwen2MoeForCausalLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2600 + step)
    d = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return d[:, :-1], d[:, 1:]
