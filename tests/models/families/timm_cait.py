"""timm CaiT: talking-heads attention (linear maps across heads before and after the
softmax), layer scale, then class-attention blocks where only the class token queries."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.cait import Cait
    return Cait(img_size=IMG, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=4.0,
                num_classes=CLASSES, depth_token_only=1, init_values=0.1, drop_rate=0.0,
                attn_drop_rate=0.0, drop_path_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
