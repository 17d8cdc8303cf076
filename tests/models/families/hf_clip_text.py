"""HF CLIPTextModelWithProjection, tiny config: causal mask built inside the model, quick-gelu
MLP, final layernorm, pooling at the argmax (eos) token of each row, a text projection; a
linear probe on the projected embedding gives the logits."""
import torch, torch.nn as nn
VOCAB, HIDDEN, LAYERS, HEADS, SEQ, PROJ, CLASSES = 64, 32, 2, 4, 16, 16, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "seq"),)

class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection
        c = CLIPTextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           max_position_embeddings=SEQ, projection_dim=PROJ,
                           attention_dropout=0.0, eos_token_id=2, pad_token_id=1,
                           bos_token_id=0)
        c._attn_implementation = "sdpa"
        self.text = CLIPTextModelWithProjection(c)
        self.head = nn.Linear(PROJ, CLASSES)
    def forward(self, idx):
        return self.head(self.text(input_ids=idx).text_embeds)

def build_model():
    return Probe()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2800 + step)
    idx = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
    ends = torch.randint(4, SEQ, (batch_size,), generator=g)
    idx[torch.arange(batch_size), ends] = 2
    return idx, torch.randint(0, CLASSES, (batch_size,), generator=g)
