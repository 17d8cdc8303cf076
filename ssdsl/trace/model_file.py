"""The model-file contract: what ``model.py`` must define, loaded and checked in one place.

A model file is ordinary PyTorch code plus a few named functions::

    def build_model() -> torch.nn.Module: ...            # required
    def get_batch(step: int, batch_size: int): ...        # required, deterministic in (step, batch_size)
        # returns (inputs, target): inputs a Tensor or a tuple of Tensors, target a Tensor
    def loss(output, target) -> torch.Tensor: ...        # optional; default: cross-entropy over the
                                                          # last dim of output (token/class logits)
    def make_optimizer(params) -> torch.optim.Optimizer   # optional; default: SGD(lr=0.01)
    BATCH_SIZE = 8                                        # optional; default batch size (default 8)
    INPUT_DIMS = (("batch", "seq"),)                      # optional; names of the flowing dims of
                                                          # each input tensor (default: dim 0 "batch")

Seeding is the caller's job: ``build_model`` is called after ``torch.manual_seed(seed)``, so two
calls with the same seed give the same parameters.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from ssdsl.errors import SsdslError


class ModelFileError(SsdslError):
    """The model file is missing, does not import, or breaks the contract."""


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits ``(..., classes)`` against integer targets ``(...)``."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


@attrs.frozen
class ModelFile:
    """A loaded, checked model file."""

    path: str
    build_model: Callable[[], torch.nn.Module]
    get_batch_fn: Callable[[int, int], Any]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_optimizer: Callable[..., torch.optim.Optimizer]
    batch_size: int
    input_dims: tuple[tuple[str, ...], ...] | None
    has_optimizer: bool

    def get_batch(self, step: int, batch_size: int | None = None
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """``(inputs, target)`` for ``step``, inputs always a tuple; checked against the contract."""
        bs = self.batch_size if batch_size is None else batch_size
        try:
            result = self.get_batch_fn(step, bs)
        except Exception as exc:
            raise ModelFileError(f"get_batch({step}, {bs}) raised {_describe(exc)}",
                                 file=self.path) from exc
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ModelFileError("get_batch(step, batch_size) must return a pair (inputs, target); "
                                 f"it returned {type(result).__name__}", file=self.path)
        inputs, target = result
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelFileError("get_batch: inputs must be a Tensor or a tuple of Tensors",
                                 file=self.path)
        if not isinstance(target, torch.Tensor):
            raise ModelFileError("get_batch: target must be a Tensor", file=self.path)
        return inputs, target

    def build(self, *, seed: int = 0) -> torch.nn.Module:
        """The model built under ``torch.manual_seed(seed)``."""
        torch.manual_seed(seed)
        try:
            model = self.build_model()
        except Exception as exc:
            raise ModelFileError(f"build_model() raised {_describe(exc)}", file=self.path) from exc
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError("build_model() must return a torch.nn.Module; it returned "
                                 f"{type(model).__name__}", file=self.path)
        return model


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


_CACHE: dict[Path, ModelFile] = {}


def load_model_file(path: str | Path) -> ModelFile:
    """Import ``path`` and check that it follows the contract (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file not found: {path}", hint="pass the path of a .py file "
                             "that defines build_model() and get_batch(step, batch_size)")
    key = p.resolve()
    if key in _CACHE:
        return _CACHE[key]
    name = f"ssdsl_model_{abs(hash(str(key)))}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError("cannot import this file as Python", file=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ModelFileError(f"syntax error at line {exc.lineno}: {exc.msg}", file=str(path)) from exc
    except Exception as exc:
        raise ModelFileError(f"importing the model file raised {_describe(exc)}",
                             file=str(path)) from exc
    _CACHE[key] = mf = _check(module, str(path))
    return mf


def _check(module: Any, path: str) -> ModelFile:
    missing = [n for n in ("build_model", "get_batch") if not callable(getattr(module, n, None))]
    if missing:
        raise ModelFileError(f"missing function{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)}", file=path,
                             hint="a model file defines build_model() -> nn.Module and "
                             "get_batch(step, batch_size) -> (inputs, target); see the README")
    for opt in ("loss", "make_optimizer"):
        if hasattr(module, opt) and not callable(getattr(module, opt)):
            raise ModelFileError(f"'{opt}' must be a function", file=path)
    batch_size = getattr(module, "BATCH_SIZE", 8)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ModelFileError(f"BATCH_SIZE must be a positive int, not {batch_size!r}", file=path)
    return ModelFile(
        path=path,
        build_model=module.build_model,
        get_batch_fn=module.get_batch,
        loss=getattr(module, "loss", default_loss),
        make_optimizer=getattr(module, "make_optimizer", default_optimizer),
        batch_size=batch_size,
        input_dims=_input_dims(getattr(module, "INPUT_DIMS", None), path),
        has_optimizer=hasattr(module, "make_optimizer"),
    )


def _input_dims(value: Any, path: str) -> tuple[tuple[str, ...], ...] | None:
    if value is None:
        return None
    ok = isinstance(value, Sequence) and all(
        isinstance(d, Sequence) and not isinstance(d, str) and all(isinstance(n, str) for n in d)
        for d in value)
    if not ok:
        raise ModelFileError("INPUT_DIMS must be a tuple with, for each input, a tuple of "
                             "dimension names, e.g. ((\"batch\", \"seq\"),)", file=path)
    return tuple(tuple(d) for d in value)
