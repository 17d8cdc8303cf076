"""timm MLP-Mixer, tiny: token-mixing MLPs over the patch dim (transpose, linear)."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=CLASSES, img_size=IMG, patch_size=8, num_blocks=2, embed_dim=32,
                    drop_rate=0.0, proj_drop_rate=0.0, drop_path_rate=0.0)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
