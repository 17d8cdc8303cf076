"""A third-party vision model: timm's VisionTransformer, built small with ``pretrained=False``.

timm imports torchvision at import time (``FrozenBatchNorm2d``, datasets and transforms in
``timm.data``), and PyPI's torchvision does not import beside this CPU torch build. A ViT uses
none of it, so when torchvision is missing this file installs stand-in ``torchvision`` modules
(every name a class that fails if used) before importing timm (install timm with
``pip install --no-deps timm`` plus pyyaml, huggingface_hub and safetensors).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

import torch
import torch.nn as nn

IMG = 32
PATCH = 8
EMBED = 32
DEPTH = 2
HEADS = 4
CLASSES = 10
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "channels", "height", "width"),)


class _Missing(types.ModuleType):
    """A stand-in torchvision module: any attribute is a class that fails when used."""

    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        return _stand_in_class(f"{self.__name__}.{name}")


class _StandInMeta(type):
    def __getattr__(cls, name: str):  # enum members and class attributes: more stand-ins
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in_class(f"{cls.__qualname__}.{name}")


def _stand_in_class(qualname: str) -> type:
    def fail(*args, **kwargs):
        raise RuntimeError(f"torchvision is not installed ({qualname})")

    return _StandInMeta(qualname.rsplit(".", 1)[-1], (), {"__init__": fail,
                                                          "__qualname__": qualname})


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Missing(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


def _stand_in_torchvision() -> None:
    """Import timm with the stand-ins in place, then take them away: timm keeps the names it
    bound, and ``torchvision`` is missing again for other libraries (transformers' vision
    models check for it and would take the stand-in for an install without a version)."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    finder = _StandInFinder()
    sys.meta_path.append(finder)
    try:
        import timm  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]


def build_model() -> nn.Module:
    _stand_in_torchvision()
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=IMG, patch_size=PATCH, embed_dim=EMBED, depth=DEPTH,
                             num_heads=HEADS, num_classes=CLASSES, drop_rate=0.0,
                             attn_drop_rate=0.0, drop_path_rate=0.0)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    return (torch.randn(batch_size, 3, IMG, IMG, generator=g),
            torch.randint(0, CLASSES, (batch_size,), generator=g))
