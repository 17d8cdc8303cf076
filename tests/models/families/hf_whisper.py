"""HF WhisperForConditionalGeneration, tiny config: a conv1d + gelu front end over log-mel
frames (stride 2), sinusoidal encoder positions, encoder-decoder with cross-attention."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, MELS, FRAMES, SEQ = 64, 32, 2, 4, 8, 32, 8
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "mels", "frames"), ("batch", "seq"))

class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import WhisperConfig, WhisperForConditionalGeneration
        c = WhisperConfig(vocab_size=VOCAB, num_mel_bins=MELS, d_model=HIDDEN,
                          encoder_layers=LAYERS, decoder_layers=LAYERS,
                          encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                          encoder_ffn_dim=4 * HIDDEN, decoder_ffn_dim=4 * HIDDEN,
                          max_source_positions=FRAMES // 2, max_target_positions=SEQ,
                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2,
                          decoder_start_token_id=0, suppress_tokens=None,
                          begin_suppress_tokens=None)
        c._attn_implementation = "sdpa"
        self.lm = WhisperForConditionalGeneration(c)
    def forward(self, mel, dec):
        return self.lm(input_features=mel, decoder_input_ids=dec, use_cache=False).logits

def build_model():
    return Seq2Seq()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2700 + step)
    mel = torch.randn(batch_size, MELS, FRAMES, generator=g)
    tgt = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
    dec = torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), tgt[:, :-1]], dim=1)
    return (mel, dec), tgt
