"""HF RobertaForMaskedLM, tiny config; MLM loss over masked positions only (ignore_index)."""
import torch, torch.nn as nn, torch.nn.functional as F
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import RobertaConfig, RobertaForMaskedLM
        c = RobertaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
                          max_position_embeddings=SEQ + 2, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pad_token_id=1)
        c._attn_implementation = "sdpa"
        self.lm = RobertaForMaskedLM(c)
    def forward(self, idx):
        return self.lm(input_ids=idx).logits

def build_model():
    return LM()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(400 + step)
    tokens = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
    chosen = torch.rand(batch_size, SEQ, generator=g) < 0.3
    inputs = torch.where(chosen, torch.full_like(tokens, 2), tokens)
    labels = torch.where(chosen, tokens, torch.full_like(tokens, -100))
    return inputs, labels

def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
