"""HF ElectraForMaskedLM, tiny config: the generator's embeddings (EMBED) projected to the
hidden width, BERT-style post-norm blocks, a gelu + layernorm head, tied output."""
import torch, torch.nn as nn
VOCAB, EMBED, HIDDEN, LAYERS, HEADS, SEQ = 64, 16, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class MaskedLM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import ElectraConfig, ElectraForMaskedLM
        c = ElectraConfig(vocab_size=VOCAB, embedding_size=EMBED, hidden_size=HIDDEN,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_size=4 * HIDDEN, max_position_embeddings=SEQ,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        c._attn_implementation = "sdpa"
        self.lm = ElectraForMaskedLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx).logits

def build_model():
    return MaskedLM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2300 + step)
    tokens = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    chosen = torch.rand(batch_size, SEQ, generator=g) < 0.15
    return torch.where(chosen, torch.zeros_like(tokens), tokens), tokens
