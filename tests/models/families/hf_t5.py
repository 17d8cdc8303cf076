"""HF T5ForConditionalGeneration, tiny config; labels shifted right inside the model."""
import torch, torch.nn as nn, torch.nn.functional as F
VOCAB, DM, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"), ("batch", "seq"))

class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration
        c = T5Config(vocab_size=VOCAB, d_model=DM, d_kv=DM // HEADS, d_ff=4 * DM,
                     num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                     dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        self.lm = T5ForConditionalGeneration(c)
    def forward(self, src, labels):
        return self.lm(input_ids=src, labels=labels, use_cache=False).logits

def build_model():
    return Seq2Seq()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(500 + step)
    src = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    tgt = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    return (src, tgt), tgt
