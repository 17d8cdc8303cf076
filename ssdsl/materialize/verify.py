"""Verifying a materialized plan, and reporting its communication.

Three checks, from local to global:

1. *Placement*: every edge's adapter starts from exactly the regions its producer's parts write
   and ends at exactly the regions its consumer's parts read (so the adapter answers the question
   the transform asked, not a neighbouring one).
2. *Adapters*: every edge adapter, forward and backward, runs with all ranks simulated in one
   process on random data, and each consumer slot must hold exactly its region's values
   (``ssdsl.runtime.comm.verify_adapter``, whose expected values are sliced from full tensors,
   not computed by the steps).
3. *Whole graph* (``simulate_plan``): every rank's parts run in one process, each edge through a
   simulated, differentiable adapter whose backward is the planned gradient adapter, the weight
   gradients through the simulated reducer; the loss and every rank's weight gradients must equal
   the plain single-device model's (the oracle). This tests transform and materialize together.

This module sits beside phase 7 but executes adapters with the runtime's simulator, so it imports
``ssdsl.runtime``; nothing in phases 1-9 imports it (it is a checking tool for tests and
``ssdsl check --verify``).

``comm_report`` renders ``Materialized.accounting()`` as a rich table, with the edges that need
the point-to-point fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from rich.table import Table

from ssdsl.errors import SsdslError
from ssdsl.ir.interpret import call_target
from ssdsl.ir.region import Region
from ssdsl.materialize.program import Edge, Materialized, _region
from ssdsl.materialize.steps import Adapter, PointToPoint
from ssdsl.runtime.comm import reduce_gradients, simulate_steps, verify_adapter
from ssdsl.runtime.reference import run_reference, to_dtype
from ssdsl.runtime.train import OptimizerSpec
from ssdsl.runtime.executor import scale_grad
from ssdsl.trace.model_file import ModelFile

EdgeKey = tuple[str, str, int]
LeafKey = tuple[str, Region]


class PlanVerificationFailed(SsdslError):
    """The simulated plan does not give a consumer its region, or differs from the plain model."""


@attrs.frozen
class PlanVerdict:
    """What ``verify_plan`` found: problems (empty: it passed) and what it looked at."""

    problems: tuple[str, ...]
    edges_checked: int
    fallback_edges: tuple[EdgeKey, ...]
    loss: float | None = None
    reference_loss: float | None = None
    max_grad_error: float | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            shown = "\n  ".join(self.problems[:20])
            more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
            raise PlanVerificationFailed(
                f"the materialized plan fails verification:\n  {shown}{more}",
                hint="this is a fault of ssdsl, not of the plan; please report it with the plan")


# -- 1 and 2: per edge ------------------------------------------------------------------------------


def edge_placement_problems(m: Materialized, key: EdgeKey) -> list[str]:
    """Whether edge ``key``'s adapter goes from its producer parts' regions to its consumers'."""
    t, edge = m.transformed, m.edges[key]
    tensor, op, slot = key
    producer = t.graph.producer()[tensor]
    j = producer.outputs.index(tensor)
    sizes = t.label_sizes(producer.name)
    want_src = sorted(((p.device, _region(t, tensor, p.sub.outputs[j], p.value_part(sizes)))
                       for p in t.parts[producer.name]), key=_key_sort)
    want_dst = sorted(((p.device, _region(t, tensor, p.sub.inputs[slot]))
                       for p in t.parts[op] if p.sub.inputs[slot] is not None), key=_key_sort)
    out = []
    if sorted(edge.adapter.producers, key=_key_sort) != want_src:
        out.append(f"edge {key}: adapter producers differ from the parts of '{producer.name}'")
    if sorted(edge.adapter.consumers, key=_key_sort) != want_dst:
        out.append(f"edge {key}: adapter consumers differ from the parts of '{op}'")
    return out


def _key_sort(p: tuple[int, Region]) -> tuple[int, str]:
    return (p[0], repr(p[1]))


def edge_problems(m: Materialized, key: EdgeKey, *, seed: int = 0) -> list[str]:
    """Placement, forward and backward problems of one edge."""
    edge = m.edges[key]
    out = edge_placement_problems(m, key)
    out += [f"edge {key} forward: {p}" for p in verify_adapter(edge.adapter, seed=seed,
                                                                atol=_atol(m.dtype))]
    back = edge.adapter.backward
    if not (edge.adapter.dtype.is_floating_point or edge.adapter.dtype.is_complex):
        return out  # a mask or index tensor carries no gradient: its backward never runs
    if back is None:
        out.append(f"edge {key}: no backward adapter")
    else:
        out += [f"edge {key} backward: {p}" for p in verify_adapter(back, seed=seed + 1,
                                                                    atol=_atol(m.dtype))]
    return out


def _atol(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-5


def uses_fallback(adapter: Adapter) -> bool:
    """Whether the adapter (forward or backward) moves data point to point."""
    steps = [*adapter.steps, *(adapter.backward.steps if adapter.backward else ())]
    return any(isinstance(s, PointToPoint) and s.count for s in steps)


# -- 3: the whole graph ------------------------------------------------------------------------------


class _SimulatedAdapter(torch.autograd.Function):
    """All ranks of one adapter at once: producer tensors in, consumer tensors out (both in the
    adapter's placement order); backward runs the planned gradient adapter, simulated."""

    @staticmethod
    def forward(ctx, adapter: Adapter, *inputs: torch.Tensor):
        ctx.adapter = adapter
        ctx.like = inputs[0].new_empty(0)
        state = _by_device(adapter.producers, inputs)
        out = simulate_steps(adapter.steps, state, inputs[0])
        result = tuple(t.clone() for t in _in_order(adapter.consumers, out))
        if not inputs[0].is_floating_point():
            ctx.mark_non_differentiable(*result)
        return result

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.adapter.backward
        held = [g if g is not None else ctx.like.new_zeros(r.local_shape)
                for g, (_, r) in zip(grads, ctx.adapter.consumers)]
        state = _by_device(back.producers, held)
        out = simulate_steps(back.steps, state, ctx.like)
        return (None, *_in_order(back.consumers, out))


def _by_device(placements: Sequence[tuple[int, Region]], tensors: Sequence[torch.Tensor]
               ) -> dict[int, list[torch.Tensor]]:
    state: dict[int, list[torch.Tensor]] = {}
    for (dev, _), x in zip(placements, tensors, strict=True):
        state.setdefault(dev, []).append(x)
    return state


def _in_order(placements: Sequence[tuple[int, Region]], state: Mapping[int, list[torch.Tensor]]
              ) -> list[torch.Tensor]:
    seen: dict[int, int] = {}
    out = []
    for dev, _ in placements:
        out.append(state[dev][seen.get(dev, 0)])
        seen[dev] = seen.get(dev, 0) + 1
    return out


@attrs.frozen(eq=False)
class Simulation:
    """One simulated training step: the loss, and every device's reduced weight gradients."""

    loss: float
    grads: Mapping[int, Mapping[LeafKey, torch.Tensor]]


def simulate_plan(m: Materialized, model_file: ModelFile, *, seed: int = 0,
                  batch_size: int | None = None) -> Simulation:
    """Forward and backward of step 0 of every rank at once, in this process, and the reducer.

    Parameters start from the seeded single-device model (``model_file.build(seed=seed)``), in
    ``m.dtype``; the batch is ``get_batch(0, batch_size)``.
    """
    g = m.transformed.graph
    _check_simulable(m)
    full = _named_values(model_file.build(seed=seed).to(m.dtype), g)
    inputs, target = model_file.get_batch(0, batch_size)
    batch = dict(zip(g.inputs, to_dtype((*inputs, target), m.dtype), strict=True))
    leaves: dict[int, dict[LeafKey, torch.Tensor]] = {}
    env: dict[int, dict[str, torch.Tensor]] = {}
    for op in g.ops:
        parts = {p.device: p for p in m.transformed.parts[op.name]}
        local: dict[int, list[Any]] = {d: [None] * len(op.inputs) for d in parts}
        for slot, name in enumerate(op.inputs):
            edge = m.edges.get((name, op.name, slot))
            if edge is not None:
                for dev, x in _run_edge(edge, env).items():
                    local[dev][slot] = x
                continue
            for dev, p in parts.items():
                if p.sub.inputs[slot] is not None:
                    local[dev][slot] = _source(m, (name, op.name, slot, dev), batch, full,
                                               leaves.setdefault(dev, {}))
        for dev, p in parts.items():
            env.setdefault(dev, {}).update(zip(op.outputs, _run_part(op, p, local[dev]),
                                               strict=True))
    return _backward_and_reduce(m, env, leaves)


def _check_simulable(m: Materialized) -> None:
    if getattr(m, "schedule", None) is not None:
        raise ValueError("simulate_plan runs one-stage plans without micro-batches only")
    meta = torch.device("meta")
    for op in m.transformed.graph.ops:
        if any(v == meta for _, v in op.kwargs):
            raise ValueError(f"operator '{op.name}' was traced on the meta device; trace with "
                             "device='cpu' to simulate the graph on real tensors")


def _run_edge(edge: Edge, env: Mapping[int, Mapping[str, torch.Tensor]]
              ) -> dict[int, torch.Tensor]:
    ad = edge.adapter
    ins = [env[d][edge.tensor] for d, _ in ad.producers]
    outs = _SimulatedAdapter.apply(ad, *ins)
    return {d: x for (d, _), x in zip(ad.consumers, outs, strict=True)}


def _source(m: Materialized, key: tuple[str, str, int, int], batch: Mapping[str, torch.Tensor],
            full: Mapping[str, torch.Tensor], leaves: dict[LeafKey, torch.Tensor]
            ) -> torch.Tensor:
    use = m.sources[key]
    name = key[0]
    if name in batch:
        return use.region.slice_of(batch[name])
    value = use.region.slice_of(full[name]).detach().clone()
    if name not in m.transformed.graph.params:
        return value
    leaf = leaves.setdefault((name, use.region), value.requires_grad_(True))
    return scale_grad(leaf, use.scale)


def _run_part(op, part, local: list[Any]) -> tuple[torch.Tensor, ...]:
    args, kwargs = part.sub.local.bind(local)
    out = call_target(part.sub.local.target, args, kwargs)
    outs = tuple(out) if op.returns == "list" else (out,)
    scale = part.sub.local.scale
    return tuple(o * scale for o in outs) if scale != 1.0 else outs


def _backward_and_reduce(m: Materialized, env: Mapping[int, Mapping[str, torch.Tensor]],
                         leaves: Mapping[int, Mapping[LeafKey, torch.Tensor]]) -> Simulation:
    g = m.transformed.graph
    out_op = g.producer()[g.output].name
    parts = {p.device: p for p in m.transformed.parts[out_op]}
    losses = [env[d][g.output] for d in sorted(parts)]
    # as on the ranks: every device's loss part is a root with gradient one; the loss of the
    # whole batch is the sum of the distinct value parts (one representative per replica set)
    torch.autograd.backward(losses, [torch.ones_like(x) for x in losses])
    loss = sum(float(env[d][g.output].detach()) for d, p in parts.items()
               if not any(p.replica_index))
    grads = {d: {k: (v.grad if v.grad is not None else torch.zeros_like(v)).detach().clone()
                 for k, v in mine.items()} for d, mine in leaves.items()}
    reduce_gradients(m.reducer, 0, {}, simulate=grads)
    return Simulation(loss, grads)


def _named_values(model: torch.nn.Module, graph) -> dict[str, torch.Tensor]:
    """Graph tensor name -> value for parameters, buffers (through tied aliases) and constants."""
    by_qual = dict(model.named_parameters(remove_duplicate=False))
    by_qual.update(dict(model.named_buffers(remove_duplicate=False)))
    out: dict[str, torch.Tensor] = {}
    for name, qual in {**graph.params, **graph.buffers}.items():
        found = [q for q in (qual, *graph.aliases.get(qual, ())) if q in by_qual]
        if found:
            out[name] = by_qual[found[0]]
    out.update({k: v for k, v in graph.constants.items() if isinstance(v, torch.Tensor)})
    return out


def compare_with_model(m: Materialized, model_file: ModelFile, sim: Simulation, *,
                       seed: int = 0, rtol: float | None = None
                       ) -> tuple[list[str], float, float]:
    """Problems of ``sim`` (step 0) against the plain model (``run_reference``), the reference
    loss, and the largest gradient error relative to the largest reference gradient entry."""
    if rtol is None:
        rtol = 1e-9 if m.dtype == torch.float64 else 1e-4
    ref = run_reference(model_file, steps=1, seed=seed, dtype=m.dtype,
                        optimizer=OptimizerSpec("sgd"), grad_steps=(0,))
    ref_loss, ref_grads = ref.losses[0], ref.grads[0]
    g = m.transformed.graph
    scale = max(float(t.abs().max()) for t in ref_grads.values())
    problems: list[str] = []
    if abs(sim.loss - ref_loss) > rtol * max(1.0, abs(ref_loss)):
        problems.append(f"loss {sim.loss!r} differs from the plain model's {ref_loss!r}")
    worst = 0.0
    for dev, mine in sorted(sim.grads.items()):
        for (name, region), grad in mine.items():
            want = region.slice_of(_ref_grad(g, ref_grads, name))
            err = float((grad - want).abs().max()) / scale if grad.numel() else 0.0
            worst = max(worst, err)
            if err > rtol:
                problems.append(f"device {dev}: gradient of {g.params[name]} {region!r} off by "
                                f"{err:.3g} (relative to the largest gradient entry)")
    return problems, ref_loss, worst


def _ref_grad(g, ref_grads: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    qual = g.params[name]
    for q in (qual, *g.aliases.get(qual, ())):
        if q in ref_grads:
            return ref_grads[q]
    raise KeyError(f"no reference gradient for {qual}")


# -- everything ---------------------------------------------------------------------------------------


def verify_plan(m: Materialized, *, seed: int = 0, model_file: ModelFile | None = None
                ) -> PlanVerdict:
    """Check every edge (placement, forward, backward) on random data; with ``model_file``, also
    simulate one whole training step and compare it with the plain model (this needs a graph
    traced on the CPU, ``trace(mf, device="cpu", model=...)``: creation ops traced on ``meta``
    keep ``device=meta``; and a one-stage plan without micro-batches).

    >>> verdict = verify_plan(materialize(transform(graph, plan)), model_file=mf)  # doctest: +SKIP
    >>> verdict.ok, verdict.fallback_edges                                         # doctest: +SKIP
    (True, ())
    """
    problems: list[str] = []
    for key in m.edges:
        problems += edge_problems(m, key, seed=seed)
    fallback = tuple(k for k, e in m.edges.items() if uses_fallback(e.adapter))
    loss = ref_loss = worst = None
    if model_file is not None:
        sim = simulate_plan(m, model_file, seed=seed)
        more, ref_loss, worst = compare_with_model(m, model_file, sim, seed=seed)
        problems += more
        loss = sim.loss
    return PlanVerdict(tuple(problems), len(m.edges), fallback, loss, ref_loss, worst)


# -- the report ---------------------------------------------------------------------------------------


def comm_report(m: Materialized, *, title: str = "communication per step"
                ) -> tuple[Table, dict[str, Any]]:
    """The plan's communication per training step as a rich table and as plain data.

    The data is ``Materialized.accounting()`` (``forward`` / ``backward`` / ``gradients``:
    ``{kind: {"count", "bytes"}}`` and ``total_bytes``) plus ``edges``: one entry per edge that
    moves anything, with its kinds, bytes, and whether it uses the point-to-point fallback.
    Bytes are totals received over all devices (``ssdsl.materialize.steps``).
    """
    acc = m.accounting()
    edges = [_edge_entry(k, e) for k, e in m.edges.items()
             if e.adapter.steps or (e.adapter.backward is not None and e.adapter.backward.steps)]
    data = {**acc, "edges": edges,
            "fallback_edges": sum(1 for e in edges if e["fallback"])}
    table = Table(title=title)
    for col, justify in (("pass", "left"), ("primitive", "left"), ("calls", "right"),
                         ("bytes", "right")):
        table.add_column(col, justify=justify)
    for section in ("forward", "backward", "gradients"):
        for kind, v in sorted(acc[section].items()):
            table.add_row(section, kind, str(v["count"]), _human(v["bytes"]))
    table.add_row("total", "", "", _human(acc["total_bytes"]), style="bold")
    if data["fallback_edges"]:
        table.caption = f"{data['fallback_edges']} edge(s) use the point-to-point fallback"
    return table, data


def _edge_entry(key: EdgeKey, e: Edge) -> dict[str, Any]:
    back = e.adapter.backward
    return {"tensor": key[0], "op": key[1], "slot": key[2],
            "forward": list(e.adapter.kinds), "forward_bytes": e.adapter.nbytes,
            "backward": list(back.kinds) if back is not None else [],
            "backward_bytes": back.nbytes if back is not None else 0,
            "fallback": uses_fallback(e.adapter)}


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
