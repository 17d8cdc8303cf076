"""HF SwinForImageClassification, tiny config: window attention with a relative position bias,
shifted windows (torch.roll and an attention mask built from window slices), patch merging."""
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import SwinConfig, SwinForImageClassification
        c = SwinConfig(image_size=IMG, patch_size=4, embed_dim=16, depths=[2, 2],
                       num_heads=[2, 4], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                       num_labels=CLASSES)
        self.swin = SwinForImageClassification(c)
    def forward(self, x):
        return self.swin(pixel_values=x).logits

def build_model():
    return Classifier()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(3600 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
