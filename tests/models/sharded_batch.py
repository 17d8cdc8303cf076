"""A test model whose batch is read row by row from a "dataset" (a seeded table), with a
``get_batch_shard`` hook that loads only the rows asked for, and records which rows it loaded
(``LOADED``) so a test can see that a rank did not load the others. ``SHARD_BUG`` set to true
makes the hook return other rows (a wrong hook, which verification must refuse). The loss is a
plain mean (no step value), so the ranks really call the hook."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

BATCH_SIZE = 8
LOADED: list[tuple[int, int, int]] = []   # (step, start, stop) per call of get_batch_shard


def _row(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + i)
    return torch.randn(12, generator=g), torch.randn(5, generator=g)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # a mean over a static number of elements: no step value (a cross-entropy's count of
    # labelled targets is one, and needs the whole batch on every rank)
    return torch.nn.functional.mse_loss(output, target)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))


def get_batch(step: int, batch_size: int):
    return get_batch_shard(step, batch_size, 0, batch_size, record=False)


def get_batch_shard(step: int, batch_size: int, start: int, stop: int, record: bool = True):
    if record:
        LOADED.append((step, start, stop))
        path = os.environ.get("SSDSL_TEST_LOADED")
        if path:
            with open(f"{path}.{os.environ.get('RANK', 'x')}", "a") as f:
                f.write(f"{step} {start} {stop}\n")
    shift = 1 if os.environ.get("SHARD_BUG") and stop - start < batch_size else 0
    rows = [_row(step, (i + shift) % batch_size) for i in range(start, stop)]
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])
