"""timm MobileNetV3, tiny: BatchNorm (batch statistics in training, running statistics as
buffers), depthwise convolutions, squeeze-excite, hard-swish."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    import timm
    return timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=CLASSES,
                             drop_rate=0.0, drop_path_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(2100 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
