"""HF ViTForImageClassification, tiny config: conv patch embedding, CLS token, pre-norm blocks."""
import torch, torch.nn as nn
IMG, PATCH, HIDDEN, LAYERS, HEADS, CLASSES = 32, 8, 32, 2, 4, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification
        c = ViTConfig(image_size=IMG, patch_size=PATCH, hidden_size=HIDDEN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      intermediate_size=4 * HIDDEN, num_labels=CLASSES,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        c._attn_implementation = "sdpa"
        self.vit = ViTForImageClassification(c)
    def forward(self, x):
        return self.vit(pixel_values=x).logits

def build_model():
    return Classifier()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(1900 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
