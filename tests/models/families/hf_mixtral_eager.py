"""HF MixtralForCausalLM with its eager experts (``_experts_implementation = "eager"``): the MoE
block loops over the experts a batch hits (``for expert_idx in expert_hit``), a loop over data
that torch.export cannot trace. ssdsl refuses it in a few lines at that loop (torch.export's own
dump of the partial graph, hundreds of lines, is held back)."""
import torch.nn as nn
VOCAB, HIDDEN, SEQ = 96, 32, 8
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM
        c = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=SEQ, num_local_experts=4,
                          num_experts_per_tok=2, attention_dropout=0.0, router_aux_loss_coef=0.0)
        c._attn_implementation = "sdpa"
        c._experts_implementation = "eager"
        self.lm = MixtralForCausalLM(c)

    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits


def build_model():
    return LM()


def get_batch(step, batch_size):
    import torch
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss(logits, target):
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
