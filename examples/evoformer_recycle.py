"""The Evoformer of ``evoformer.py`` with AlphaFold2 recycling: the trunk (the block stack) runs
``RECYCLES`` times per step, each pass's output fed back, through a recycling embedding (a layer
norm of the previous MSA and pair representations added to the inputs), into the next pass.

Only the last pass is trained: the earlier ones' outputs are ``.detach()``-ed, as AlphaFold2
stops the gradient of recycled values, so backward never reaches them. The traced graph holds
``RECYCLES`` copies of every block's operators, told apart by the call number of their module
(``blocks.0`` called the 2nd time); ``stdlib_plans/recycle_1f1b.ssp`` (3F1B) pipelines the
passes with forward-only units for all but the last.

(``torch.no_grad()`` around the first passes would give the same gradients, but torch.export
traces it as a ``wrap_with_set_grad_enabled`` sub-graph, which the tracer does not inline.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

_spec = importlib.util.spec_from_file_location("_ssdsl_example_evoformer",
                                               Path(__file__).with_name("evoformer.py"))
evo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(evo)

RECYCLES = 3
N_BLOCKS = 1  # one block per pass keeps the three-fold graph small for gloo tests
BATCH_SIZE = evo.BATCH_SIZE
INPUT_DIMS = evo.INPUT_DIMS


class RecyclingEvoformer(nn.Module):
    def __init__(self, recycles: int = RECYCLES) -> None:
        super().__init__()
        self.recycles = recycles
        self.blocks = nn.ModuleList(evo.EvoformerBlock() for _ in range(N_BLOCKS))
        self.recycle_norm_m = nn.LayerNorm(evo.C_M)
        self.recycle_norm_z = nn.LayerNorm(evo.C_Z)
        self.distogram = nn.Linear(evo.C_Z, evo.BINS)

    def forward(self, m_in: torch.Tensor, z_in: torch.Tensor) -> torch.Tensor:
        m, z = m_in, z_in
        for r in range(self.recycles):
            if r > 0:  # the recycling embedding of the previous pass's (detached) output
                m = m_in + self.recycle_norm_m(m)
                z = z_in + self.recycle_norm_z(z)
            for block in self.blocks:
                m, z = block(m, z)
            if r < self.recycles - 1:  # AlphaFold2 stops the gradient of recycled values
                m, z = m.detach(), z.detach()
        return self.distogram(z)


def build_model() -> nn.Module:
    return RecyclingEvoformer()


def get_batch(step: int, batch_size: int):
    return evo.get_batch(step, batch_size)
