"""A test model with Phi-3's fused MLP: one ``gate_up`` linear whose output ``chunk(2)`` cuts
into the gate and the up halves, ``up * silu(gate)``, then ``down``."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH, HIDDEN, SEQ = 8, 12, 4
BATCH_SIZE = 4
INPUT_DIMS = (("batch", "seq", "width"),)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(WIDTH, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(up * torch.nn.functional.silu(gate))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.mlp = Mlp()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head((h + self.mlp(h)).mean(1))


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(600 + step)
    return torch.randn(batch_size, SEQ, WIDTH, generator=g), torch.randint(0, 3, (batch_size,),
                                                                             generator=g)
