"""timm ResNet, tiny (basic blocks), GroupNorm instead of BatchNorm (per-example statistics)."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.resnet import ResNet, BasicBlock
    class GN(nn.GroupNorm):
        def __init__(self, c, **kw):
            super().__init__(4, c, **kw)
    return ResNet(block=BasicBlock, layers=(1, 1, 1, 1), num_classes=CLASSES, stem_width=16,
                  channels=(16, 16, 32, 32),
                  norm_layer=GN, drop_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(800 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
