"""timm PoolFormer (MetaFormer): token mixing by average pooling minus the input, GroupNorm
with one group, 1x1-conv MLPs, layer scale, strided conv downsampling between stages."""
import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch, torch.nn as nn
IMG, CLASSES = 32, 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)
def build_model():
    from examples.timm_vit import _stand_in_torchvision
    _stand_in_torchvision()
    from timm.models.metaformer import MetaFormer
    from timm.models.metaformer import Pooling, GroupNorm1, GroupNorm1NoBias
    return MetaFormer(depths=(1, 1), dims=(16, 32), token_mixers=Pooling,
                      norm_layers=GroupNorm1, mlp_act=nn.GELU, mlp_bias=True,
                      num_classes=CLASSES, drop_rate=0.0, drop_path_rate=0.0,
                      layer_scale_init_values=1e-5, res_scale_init_values=None,
                      downsample_norm=None)
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(3200 + step)
    return torch.randn(batch_size, 3, IMG, IMG, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)
