"""The per-rank executor: run this rank's parts, the adapters, backward, reducers, optimizer.

Every rank walks the operators in graph order and, for each data edge, calls the edge's adapter
when it takes part in it, so the collectives of all ranks line up without any extra
synchronisation. Forward runs each part's local ATen call; backward is autograd through those
calls and through the adapters (whose backward is the planned gradient adapter); weight gradients
are then summed by the reducer's buckets and the optimizer steps on this rank's shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ssdsl.ir.interpret import call_target
from ssdsl.ir.region import Region
from ssdsl.materialize.program import Materialized
from ssdsl.runtime.comm import reduce_gradients, run_adapter
from ssdsl.runtime.groups import ProcessGroups, groups_of
from ssdsl.runtime.reference import to_dtype
from ssdsl.runtime.train import OptimizerSpec, build_optimizer
from ssdsl.trace.model_file import ModelFile


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient is multiplied by ``scale`` (a replica's share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


@attrs.define
class RankState:
    """This rank's shards of the parameters, keyed by (graph tensor name, region)."""

    leaves: dict[tuple[str, Region], torch.Tensor]
    fixed: dict[tuple[str, Region], torch.Tensor]


class RankProgram:
    """One rank's view of a materialized plan, ready to train."""

    def __init__(self, m: Materialized, rank: int, model_file: ModelFile, model: torch.nn.Module,
                 *, dtype: torch.dtype, optimizer: OptimizerSpec, groups: ProcessGroups | None):
        self.m, self.rank, self.mf, self.dtype = m, rank, model_file, dtype
        self.graph = m.transformed.graph
        self.groups = groups
        self.my_parts = {op.name: m.part_on(op.name, rank) for op in self.graph.ops}
        self.state = self._init_state(model)
        self.opt = build_optimizer(optimizer, model_file, list(self.state.leaves.values()))

    # ------------------------------------------------------------------ setup
    def _init_state(self, model: torch.nn.Module) -> RankState:
        """Slices of the seeded single-device model's parameters that this rank's parts read."""
        full = _named_values(model, self.graph)
        leaves: dict[tuple[str, Region], torch.Tensor] = {}
        fixed: dict[tuple[str, Region], torch.Tensor] = {}
        for (name, _op, _slot, device), use in self.m.sources.items():
            if device != self.rank or name not in full:
                continue
            key = (name, use.region)
            if name in self.graph.params and key not in leaves:
                leaves[key] = use.region.slice_of(full[name]).detach().clone().requires_grad_(True)
            elif name not in self.graph.params and key not in fixed:
                fixed[key] = use.region.slice_of(full[name]).detach().clone()
        return RankState(leaves, fixed)

    # ------------------------------------------------------------------ one step
    def forward(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, list]:
        """This rank's local loss part (None without one) and the tokens backward must visit."""
        full_inputs = dict(zip(self.graph.inputs, batch, strict=True))
        env: dict[str, torch.Tensor] = {}
        tokens: list[torch.Tensor] = []
        for op in self.graph.ops:
            part = self.my_parts[op.name]
            local: list[Any] = [None] * len(op.inputs)
            for slot, name in enumerate(op.inputs):
                reads = part is not None and part.sub.inputs[slot] is not None
                edge = self.m.edges.get((name, op.name, slot))
                if edge is not None:
                    if self.rank in edge.adapter.devices:
                        got = run_adapter(edge.adapter, self.rank, env.get(name), groups=self.groups)
                        if reads:
                            local[slot] = got
                        elif got is not None:
                            tokens.append(got)
                elif reads:
                    local[slot] = self._source(name, op.name, slot, full_inputs)
            if part is not None:
                args, kwargs = part.sub.local.bind(local)
                out = call_target(part.sub.local.target, args, kwargs)
                outs = tuple(out) if op.returns == "list" else (out,)
                if part.sub.local.scale != 1.0:
                    outs = tuple(o * part.sub.local.scale for o in outs)
                env.update(zip(op.outputs, outs, strict=True))
        return env.get(self.graph.output), tokens

    def _source(self, name: str, op: str, slot: int, inputs: Mapping[str, torch.Tensor]
                ) -> torch.Tensor:
        use = self.m.sources[(name, op, slot, self.rank)]
        if name in inputs:
            return use.region.slice_of(inputs[name])
        if name in self.graph.params:
            leaf = self.state.leaves[(name, use.region)]
            return _ScaleGrad.apply(leaf, use.scale) if use.scale != 1.0 else leaf
        return self.state.fixed[(name, use.region)]

    def step(self, step: int, batch_size: int | None) -> float:
        """One training step; returns the loss of the whole batch (same on every rank)."""
        inputs, target = self.mf.get_batch(step, batch_size)
        batch = tuple(to_dtype((*inputs, target), self.dtype))
        self.opt.zero_grad(set_to_none=True)
        loss, tokens = self.forward(batch)
        roots = ([loss] if loss is not None else []) + tokens
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
        grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v))
                 for k, v in self.state.leaves.items()}
        for k, v in self.state.leaves.items():
            v.grad = grads[k]
        reduce_gradients(self.m.reducer, self.rank, grads, groups=self.groups)
        self.opt.step()
        return self._total_loss(loss)

    def _total_loss(self, loss: torch.Tensor | None) -> float:
        """Sum of the distinct value parts of the loss (one representative per replica set)."""
        part = self.my_parts[self.graph.producer()[self.graph.output].name]
        mine = 0.0
        if loss is not None and part is not None and not any(part.replica_index):
            mine = float(loss.detach())
        total = torch.tensor([mine], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(total)
        return float(total.item())

    # ------------------------------------------------------------------ results
    def shards(self) -> list[tuple[str, Region, torch.Tensor]]:
        """This rank's parameter shards as (qualified name, region, values)."""
        return [(self.graph.params[name], region, t.detach().cpu().clone())
                for (name, region), t in self.state.leaves.items()]


def assemble(shards: list[tuple[str, Region, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's shards (a region held by several ranks is taken once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, Region]] = set()
    for qual, region, t in shards:
        if (qual, region) in seen:
            continue
        seen.add((qual, region))
        full = out.setdefault(qual, torch.zeros(region.shape, dtype=t.dtype))
        Region.full(region.shape).add_into(full, region, t)
    return out


def create_groups(m: Materialized) -> ProcessGroups:
    """Every process group the program uses, created on every rank in the same order."""
    return ProcessGroups.create(groups_of([e.adapter for e in m.edges.values()], [m.reducer]))


def _named_values(model: torch.nn.Module, graph) -> dict[str, torch.Tensor]:
    """Graph tensor name -> value, for parameters, buffers and lifted constants."""
    by_qual = dict(model.named_parameters(remove_duplicate=False))
    by_qual.update(dict(model.named_buffers(remove_duplicate=False)))
    out: dict[str, torch.Tensor] = {}
    for name, qual in {**graph.params, **graph.buffers}.items():
        for q in (qual, *graph.aliases.get(qual, ())):
            if q in by_qual:
                out[name] = by_qual[q]
                break
    for name, value in graph.constants.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
    return out
