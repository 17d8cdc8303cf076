"""HF BartForConditionalGeneration, tiny config: encoder-decoder, cross-attention, learned
positions with an offset, decoder inputs shifted from the labels, tied embeddings."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"), ("batch", "seq"))

class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import BartConfig, BartForConditionalGeneration
        c = BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS,
                       decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                       decoder_attention_heads=HEADS, encoder_ffn_dim=4 * HIDDEN,
                       decoder_ffn_dim=4 * HIDDEN, max_position_embeddings=SEQ,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2,
                       decoder_start_token_id=2, forced_eos_token_id=None)
        c._attn_implementation = "sdpa"
        self.lm = BartForConditionalGeneration(c)
    def forward(self, src, dec):
        return self.lm(input_ids=src, decoder_input_ids=dec, use_cache=False).logits

def build_model():
    return Seq2Seq()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(1700 + step)
    src = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
    tgt = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
    dec = torch.cat([torch.full((batch_size, 1), 2), tgt[:, :-1]], dim=1)
    return (src, dec), tgt
