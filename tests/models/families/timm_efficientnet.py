"""timm EfficientNet-B0 layout, narrowed: depthwise-separable and inverted-residual blocks with
squeeze-and-excitation (a mean over the image, two 1x1 convs, a sigmoid gate), SiLU,
BatchNorm."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.efficientnet import EfficientNet
    from timm.models._efficientnet_builder import decode_arch_def
    arch = [["ds_r1_k3_s1_e1_c8_se0.25"], ["ir_r1_k3_s2_e4_c16_se0.25"],
            ["ir_r1_k5_s2_e4_c24_se0.25"]]
    return EfficientNet(decode_arch_def(arch), num_classes=CLASSES, stem_size=8,
                        num_features=64, drop_rate=0.0, drop_path_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(3100 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
