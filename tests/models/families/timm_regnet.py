"""timm RegNetY, narrowed: bottleneck blocks whose 3x3 conv is grouped (group width 4),
squeeze-and-excitation, BatchNorm."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.regnet import RegNet, RegNetCfg
    cfg = RegNetCfg(depth=4, w0=8, wa=12.0, wm=1.6, group_size=4, se_ratio=0.25,
                    stem_width=16)
    return RegNet(cfg, num_classes=CLASSES, drop_rate=0.0, drop_path_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(3400 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
