"""timm ConvNeXt, tiny: depthwise 7x7 convs, LayerNorm2d, MLP as linears, global pool head."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.convnext import ConvNeXt
    return ConvNeXt(in_chans=3, num_classes=CLASSES, depths=(1, 1, 1, 1), dims=(8, 16, 16, 32),
                    drop_path_rate=0.0, drop_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(600 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
