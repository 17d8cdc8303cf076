"""Every rank's program in one process: the in-process backend of the one walk.

``SimRunner`` is a ``Runner`` whose meetings yield to ``ssdsl.lower.walk.Exchange``: sends go to
its mailbox, receives and collectives wait there until their peers arrive, and collectives are
computed from every member's contribution (``ssdsl.runtime.comm.combine``). ``simulate_programs``
runs one training step of all ranks this way, without an optimizer step, and returns the loss
and every rank's reduced weight gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from ssdsl.ir.interpret import with_step_values
from ssdsl.ir.region import Region
from ssdsl.lower import Program, Wait, run_all, walk
from ssdsl.lower.walk import Exchange
from ssdsl.materialize.program import Materialized
from ssdsl.runtime.comm import combine
from ssdsl.runtime.executor import Runner, init_state
from ssdsl.runtime.reference import to_dtype
from ssdsl.runtime.zero import zero_shards
from ssdsl.trace.model_file import ModelFile

LeafKey = tuple[str, Region]


class SimRunner(Runner):
    """A rank's handlers whose communication meets the other ranks in this process."""

    def __init__(self, *args: Any, exchange: Exchange, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exchange = exchange

    def meet(self, w: Wait) -> Iterator[Wait]:
        yield w

    def post(self, msg, piece: torch.Tensor, ins: Any) -> None:
        self.exchange.send(self.rank, msg, ins, payload=piece.clone(),
                           shape=tuple(piece.shape))


@attrs.frozen(eq=False)
class Simulation:
    """One simulated training step: the loss, and every device's reduced weight gradients;
    ``losses``: the loss each rank reports (every rank reports the step's loss)."""

    loss: float
    grads: Mapping[int, Mapping[LeafKey, torch.Tensor]]
    losses: Mapping[int, float | None] = attrs.field(factory=dict)
    # every rank's parameter shards after its optimizer's step (empty: the optimizer did not
    # step); a ZeRO stage-3 rank's weights gathered again
    params: Mapping[int, Mapping[LeafKey, torch.Tensor]] = attrs.field(factory=dict)


def simulate_programs(m: Materialized, programs: Sequence[Program], model: torch.nn.Module,
                      batch: tuple[torch.Tensor, ...], *, dtype: torch.dtype | None = None,
                      optimizer: Any = None, model_file: ModelFile | None = None
                      ) -> Simulation:
    """Run ``programs`` (one per rank) on ``batch`` with shards of ``model``, all in this
    process; the optimizer does not step, unless ``optimizer`` (an ``OptimizerSpec``, with the
    ``model_file`` whose ``make_optimizer`` it may name) is given: then each rank steps the
    optimizer its trainer builds (``RankProgram``: ZeRO chunks in their weights' groups).

    ``dtype``: the floating dtype to run in, when not the plan's (``m.dtype``): the very
    programs planned in float32 run in float64, the dtypes their calls name included
    (``Runner.retype``), so verification needs no second plan."""
    run = m.dtype if dtype is None else dtype
    retype = {m.dtype: run} if run != m.dtype else None
    exchange = Exchange(combine)
    # the step values (``Graph.prologue``) follow the batch, as on the ranks (floats in ``run``)
    batch = to_dtype(with_step_values(m.transformed.graph, to_dtype(tuple(batch), run)), run)
    runners = {}
    for p in programs:
        state = init_state(m, p.rank, model, dtype=run)
        zero = zero_shards(p, state.leaves)
        opt = None
        if optimizer is not None:
            from ssdsl.runtime.train import build_optimizer
            from ssdsl.runtime.zero import optimizer_params
            opt = build_optimizer(optimizer, model_file, *optimizer_params(state.leaves, zero))
        r = SimRunner(p.rank, state, dtype=run, exchange=exchange, zero=zero, retype=retype,
                      opt=opt)
        r.start(batch)
        r.prepare(p)
        runners[p.rank] = r
    run_all({p.rank: walk(p, runners[p.rank]) for p in programs}, exchange)
    loss = next(r.loss_total for r in runners.values() if r.loss_total is not None)
    grads = {rank: {k: v.grad.detach().clone() for k, v in r.state.leaves.items()
                    if v.grad is not None}
             for rank, r in runners.items() if r.state.leaves}
    _sharded_grads(runners, grads)
    params: dict[int, dict[LeafKey, torch.Tensor]] = {}
    if optimizer is not None:
        from ssdsl.runtime.zero import rebuild_weights
        rebuild_weights({rank: r.zero for rank, r in runners.items()})  # stage 3: sharded
        params = {rank: {k: v.detach().clone() for k, v in r.state.leaves.items()}
                  for rank, r in runners.items() if r.state.leaves}
    return Simulation(loss, grads, {rank: r.loss_total for rank, r in runners.items()}, params)


def _sharded_grads(runners: Mapping[int, SimRunner],
                   grads: dict[int, dict[LeafKey, torch.Tensor]]) -> None:
    """The reduced gradients of ZeRO-sharded buckets, from every member's chunk: under stage 2
    no rank holds them whole, so they are assembled here to compare with the plain model."""
    for rank, r in runners.items():
        for bucket, shard in r.zero.items():
            chunks = [runners[q].zero[bucket].param.grad for q in shard.ins.group]
            flat = torch.cat([c.detach() for c in chunks if c is not None])
            offset = 0
            for key in shard.ins.entries:
                leaf = r.state.leaves[key]
                grads[rank][key] = flat[offset:offset + leaf.numel()].view_as(leaf).clone()
                offset += leaf.numel()


def simulate_model_file(m: Materialized, programs: Sequence[Program], model_file: ModelFile, *,
                        seed: int = 0, batch_size: int | None = None,
                        dtype: torch.dtype | None = None, optimizer: Any = None) -> Simulation:
    """``simulate_programs`` on the seeded model (in ``dtype``, default ``m.dtype``) and
    ``get_batch(0, ...)``; ``optimizer``: each rank steps it (``simulate_programs``)."""
    model = model_file.build(seed=seed).to(m.dtype if dtype is None else dtype)
    inputs, target = model_file.get_batch(0, batch_size)
    return simulate_programs(m, programs, model, (*inputs, target), dtype=dtype,
                             optimizer=optimizer, model_file=model_file)
