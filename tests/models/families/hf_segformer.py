"""HF SegformerForImageClassification, tiny config: overlapping strided conv patch embeddings
per stage, efficient self-attention whose keys and values come from a strided conv (spatial
reduction) and a layernorm, Mix-FFN (a depthwise 3x3 conv between the two linears), tokens
reshaped back to images between stages."""
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import SegformerConfig, SegformerForImageClassification
        c = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1],
                            sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                            strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            classifier_dropout_prob=0.0, drop_path_rate=0.0,
                            num_labels=CLASSES)
        self.seg = SegformerForImageClassification(c)
    def forward(self, x):
        return self.seg(pixel_values=x).logits

def build_model():
    return Classifier()

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(3300 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
