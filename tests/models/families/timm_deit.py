"""timm DeiT (distilled): class and distillation tokens, two heads averaged."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.deit import VisionTransformerDistilled
    return VisionTransformerDistilled(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                      num_classes=CLASSES, drop_rate=0.0, attn_drop_rate=0.0,
                                      drop_path_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
