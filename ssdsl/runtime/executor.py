"""The per-rank executor: run this rank's parts, the adapters, backward, reducers, optimizer.

Every rank walks the operators in graph order and, for each data edge, calls the edge's adapter
when it takes part in it, so the collectives of all ranks line up without any extra
synchronisation. Forward runs each part's local ATen call; backward is autograd through those
calls and through the adapters (whose backward is the planned gradient adapter); weight gradients
are then summed by the reducer's buckets and the optimizer steps on this rank's shards.

Pipelines (stages, micro-batches) run the same walk per unit ``F(s, k)`` over stage s's
operators on micro-batch k, and ``B(s, k)`` as one autograd backward from that unit's roots, in
the order of this rank's schedule program (``ssdsl.runtime.pipeline``, ``docs/pipelines.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from torch.utils.checkpoint import checkpoint

from ssdsl.ir.interpret import call_target
from ssdsl.ir.region import Region
from ssdsl.materialize.program import Materialized, UnsupportedPlacement
from ssdsl.runtime.comm import reduce_gradients, run_adapter, wait_sends
from ssdsl.runtime.groups import ProcessGroups, groups_of
from ssdsl.runtime.pipeline import PipelineLayout, recompute_ops
from ssdsl.runtime.reference import to_dtype
from ssdsl.runtime.train import OptimizerSpec, build_optimizer
from ssdsl.schedule.units import Pass, Unit
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


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` whose gradient counts ``scale`` times (one replica's share of a weight's gradient)."""
    return _ScaleGrad.apply(x, scale) if scale != 1.0 else x


@attrs.define
class RankState:
    """This rank's shards of the parameters, keyed by (graph tensor name, region)."""

    leaves: dict[tuple[str, Region], torch.Tensor]
    fixed: dict[tuple[str, Region], torch.Tensor]


@attrs.define
class _MicroBatch:
    """What one micro-batch's units leave for the later units of this rank."""

    inputs: dict[str, torch.Tensor]               # this micro-batch's slice of each graph input
    env: dict[str, torch.Tensor] = attrs.Factory(dict)       # produced tensors, this rank's parts
    made_in: dict[str, int] = attrs.Factory(dict)             # tensor -> stage that produced it
    roots: dict[int, list] = attrs.Factory(dict)              # stage -> [(tensor, grad | None)]
    bridges: dict[int, list] = attrs.Factory(dict)            # stage -> [(value, detached, stage)]
    loss: torch.Tensor | None = None


class RankProgram:
    """One rank's view of a materialized plan, ready to train.

    A plan without stages or micro-batches runs ``forward`` then one backward. A pipelined plan
    runs this rank's schedule program unit by unit (see ``run_unit``).
    """

    def __init__(self, m: Materialized, rank: int, model_file: ModelFile, model: torch.nn.Module,
                 *, dtype: torch.dtype, optimizer: OptimizerSpec, groups: ProcessGroups | None):
        self.m, self.rank, self.mf, self.dtype = m, rank, model_file, dtype
        self.graph = m.transformed.graph
        self.groups = groups
        self.my_parts = {op.name: m.part_on(op.name, rank) for op in self.graph.ops}
        self._loss_part = self.my_parts[self.graph.producer()[self.graph.output].name]
        self.state = self._init_state(model)
        self.opt = build_optimizer(optimizer, model_file, list(self.state.leaves.values()))
        self.layout = PipelineLayout.of(m)
        self.program = self.layout.program_of(rank)
        self.recompute = recompute_ops(m)
        self.direct = frozenset(key for key, e in m.edges.items() if _passthrough(e.adapter, rank))
        # the edges this rank runs as a producer only, right after their producer (its sends)
        self.sends = {op: [key for key in keys if self.layout.at_consumer[key].get(rank) is False]
                      for op, keys in self.layout.sends_after.items()}
        self._mbs: dict[int, _MicroBatch] = {}
        # the most activations (tensors of this rank's parts) alive at once, over all steps
        self.peak_live = 0

    @property
    def pipelined(self) -> bool:
        """Whether a step runs several units (stages or micro-batches)."""
        return self.m.schedule is not None or self.m.transformed.microbatches > 1 \
            or bool(self.recompute)

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

    # ------------------------------------------------------------------ units
    def begin(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Start a step on the whole batch: every micro-batch's slice of the graph inputs."""
        full = dict(zip(self.graph.inputs, batch, strict=True))
        boxes = self.m.transformed.input_boxes
        self._mbs = {k: _MicroBatch({name: boxes[name][k].slice_of(x) if name in boxes else x
                                     for name, x in full.items()})
                     for k in range(self.m.transformed.microbatches)}

    def run_unit(self, unit: Unit) -> None:
        """Run ``F(s, k)`` or ``B(s, k)`` of this rank's program."""
        if unit.kind is Pass.F:
            self.forward_unit(unit.stage, unit.mb)
        elif unit.kind is Pass.B:
            self.backward_unit(unit.stage, unit.mb)
        else:
            raise UnsupportedPlacement(f"unit {unit}: split backward passes (I/W) are not run "
                                       "yet", None, hint="order whole backward passes")

    def forward_unit(self, stage: int, k: int) -> None:
        """The forward of this rank's parts of ``stage`` on micro-batch ``k``, with the adapters
        this rank joins there: receives into the stage, sends out of it (which do not block)."""
        mb = self._mbs[k]
        ops = self.layout.ops_of[stage]
        i = 0
        while i < len(ops):
            j = i
            while j < len(ops) and ops[j].name in self.recompute:
                j += 1
            if j > i:
                self._run_checkpointed(ops[i:j], stage, k, mb)
                i = j
            else:
                self._run_op(ops[i], stage, k, mb)
                i += 1
        live = sum(len(m.env) for m in self._mbs.values())
        self.peak_live = max(self.peak_live, live)

    def backward_unit(self, stage: int, k: int) -> None:
        """Backward of ``stage`` on micro-batch ``k``: from its loss part, the tokens of its sends
        and the gradients later stages on this rank left for it; gradients accumulate in
        ``.grad`` of the shards, and those for earlier stages on this rank are left for them."""
        mb = self._mbs[k]
        roots = [(t, g) for t, g in mb.roots.pop(stage, []) if t.requires_grad]
        if roots:
            torch.autograd.backward([t for t, _ in roots],
                                    [torch.ones_like(t) if g is None else g for t, g in roots])
        for value, detached, source_stage in mb.bridges.pop(stage, []):
            if detached.grad is not None:
                mb.roots.setdefault(source_stage, []).append((value, detached.grad))
        for name in [n for n, s in mb.made_in.items() if s == stage]:
            mb.env.pop(name, None)  # this stage's activations are no longer needed
            mb.made_in.pop(name)

    def _run_op(self, op, stage: int, k: int, mb: _MicroBatch) -> None:
        part = self.my_parts[op.name]
        local: list[Any] = [None] * len(op.inputs)
        for slot, name in enumerate(op.inputs):
            reads = part is not None and part.sub.inputs[slot] is not None
            key = (name, op.name, slot)
            edge = self.m.edges.get(key)
            if edge is not None:
                if key in self.direct:  # nothing moves: skip the adapter's autograd node
                    if reads:
                        local[slot] = self._value(name, stage, mb)
                elif self.layout.at_consumer.get(key, {}).get(self.rank):
                    got = run_adapter(edge.adapter, self.rank, self._value(name, stage, mb),
                                      groups=self.groups, tag=self.layout.tag(key, k))
                    if reads:
                        local[slot] = got
                    elif got is not None:
                        mb.roots.setdefault(stage, []).append((got, None))
            elif reads:
                local[slot] = self._source(name, op.name, slot, mb.inputs)
        if part is not None:
            args, kwargs = part.sub.local.bind(local)
            try:
                out = _call(part.sub.local.target, args, kwargs)
            except RuntimeError as err:  # name the operator: torch's message does not
                raise RuntimeError(f"operator '{op.name}' ({part.sub.local.target}, part "
                                   f"{part.index}) on rank {self.rank}: {err}") from err
            outs = tuple(out) if op.returns == "list" else (out,)
            if part.sub.local.scale != 1.0:
                outs = tuple(o * part.sub.local.scale for o in outs)
            mb.env.update(zip(op.outputs, outs, strict=True))
            mb.made_in.update((x, stage) for x in op.outputs)
            if self.graph.output in op.outputs:
                mb.loss = mb.env[self.graph.output]
                mb.roots.setdefault(stage, []).append((mb.loss, None))
        for key in self.sends.get(op.name, ()):
            edge = self.m.edges[key]
            got = run_adapter(edge.adapter, self.rank, mb.env.get(edge.tensor),
                              groups=self.groups, tag=self.layout.tag(key, k))
            if got is not None:
                mb.roots.setdefault(stage, []).append((got, None))

    def _value(self, name: str, stage: int, mb: _MicroBatch) -> torch.Tensor | None:
        """This rank's producer value of ``name`` for a consumer in ``stage``; a value made by an
        earlier stage is cut from its graph (that stage's backward gets its gradient later)."""
        value = mb.env.get(name)
        made = mb.made_in.get(name)
        if value is None or made is None or made == stage:
            return value
        detached = value.detach().requires_grad_(value.requires_grad)
        mb.bridges.setdefault(stage, []).append((value, detached, made))
        return detached

    def _run_checkpointed(self, ops: list, stage: int, k: int, mb: _MicroBatch) -> None:
        """Run ``ops`` keeping none of their activations: backward recomputes them."""
        if all(self.my_parts[op.name] is None for op in ops):
            for op in ops:
                self._run_op(op, stage, k, mb)
            return
        inside = {x for op in ops for x in op.outputs}
        used_after = self.layout.used_outside(ops, inside)
        outer = [n for n in dict.fromkeys(x for op in ops for x in op.inputs)
                 if n not in inside and n in mb.env]

        def segment(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            scratch = _MicroBatch(mb.inputs, dict(zip(outer, values)), dict.fromkeys(outer, stage))
            for op in ops:
                self._run_op(op, stage, k, scratch)
            scratch.roots.pop(stage, None)
            return tuple(scratch.env[n] for n in used_after if n in scratch.env)

        values = [self._value(n, stage, mb) for n in outer]  # cut where an earlier stage made it
        results = checkpoint(segment, *values, use_reentrant=False)
        present = [n for n in used_after if self.my_parts[self.layout.producer[n]] is not None]
        mb.env.update(zip(present, results, strict=True))
        mb.made_in.update((n, stage) for n in present)
        if self.graph.output in present:
            mb.loss = mb.env[self.graph.output]
            mb.roots.setdefault(stage, []).append((mb.loss, None))

    # ------------------------------------------------------------------ one step
    def forward(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, list]:
        """This rank's local loss part (None without one) and the tokens backward must visit
        (a plan of one stage and one micro-batch)."""
        self.begin(batch)
        self.forward_unit(0, 0)
        mb = self._mbs[0]
        tokens = [t for t, _ in mb.roots.get(0, []) if t is not mb.loss]
        return mb.loss, tokens

    def _source(self, name: str, op: str, slot: int, inputs: Mapping[str, torch.Tensor]
                ) -> torch.Tensor:
        use = self.m.sources[(name, op, slot, self.rank)]
        if name in inputs:
            return use.region.slice_of(inputs[name])
        if name in self.graph.params:
            leaf = self.state.leaves[(name, use.region)]
            return scale_grad(leaf, use.scale)
        return self.state.fixed[(name, use.region)]

    def step(self, step: int, batch_size: int | None) -> float:
        """One training step on the model file's batch ``step``; the loss of the whole batch."""
        inputs, target = self.mf.get_batch(step, batch_size)
        return self.train_batch((*inputs, target))

    def train_batch(self, batch: tuple[torch.Tensor, ...]) -> float:
        """Forward, backward, gradient reduction and optimizer step on the whole (global) batch
        ``(*inputs, target)``, the same on every rank; returns its loss (same on every rank)."""
        batch = tuple(to_dtype(tuple(batch), self.dtype))
        self.opt.zero_grad(set_to_none=True)
        if self.pipelined:
            self.begin(batch)
            for unit in self.program:
                self.run_unit(unit)
            losses = [mb.loss for mb in self._mbs.values() if mb.loss is not None]
        else:
            loss, tokens = self.forward(batch)
            roots = ([loss] if loss is not None else []) + tokens
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
            losses = [loss] if loss is not None else []
        wait_sends()
        self._mbs = {}
        grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v))
                 for k, v in self.state.leaves.items()}
        for k, v in self.state.leaves.items():
            v.grad = grads[k]
        reduce_gradients(self.m.reducer, self.rank, grads, groups=self.groups)
        self.opt.step()
        return self._total_loss(losses)

    def _total_loss(self, losses: list[torch.Tensor]) -> float:
        """Sum of the distinct value parts of the loss (one representative per replica set)."""
        part = self._loss_part
        mine = 0.0
        if part is not None and not any(part.replica_index):
            mine = float(sum(float(x.detach()) for x in losses))
        total = torch.tensor([mine], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(total)
        return float(total.item())

    # ------------------------------------------------------------------ results
    def shards(self) -> list[tuple[str, Region, torch.Tensor]]:
        """This rank's parameter shards as (qualified name, region, values); a tied parameter
        under each of its names, as ``state_dict`` lists it."""
        return [(qual, region, t.detach().cpu().clone())
                for (name, region), t in self.state.leaves.items()
                for qual in (self.graph.params[name], *self.graph.aliases.get(
                    self.graph.params[name], ()))]


def _passthrough(adapter, rank: int) -> bool:
    """Whether ``adapter`` only hands this rank's own tensor to itself (no step either way)."""
    if adapter.steps or (adapter.backward is not None and adapter.backward.steps):
        return False
    mine = [r for d, r in adapter.producers if d == rank]
    wanted = [r for d, r in adapter.consumers if d == rank]
    return len(mine) == 1 and mine == wanted


def _call(target: str, args: tuple, kwargs: dict) -> Any:
    """``call_target``, with a ``view`` that cannot alias its input done as a reshape.

    A graph traced on real tensors omits the ``contiguous()`` that was a no-op there (attention's
    output was already laid out for the view); a received activation can be laid out otherwise.
    """
    try:
        return call_target(target, args, kwargs)
    except RuntimeError:
        if target != "aten.view.default":
            raise
        return torch.ops.aten.reshape.default(*args, **kwargs)


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
