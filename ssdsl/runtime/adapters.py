"""One adapter by itself, run through the executor's own communication handlers.

Programs run adapters as ``comm`` instructions (``ssdsl.lower``); these functions make the same
instructions for a single adapter, so tests and the adapter verifier exercise exactly the code
that runs in a training step, on torch.distributed (``run_adapter``, differentiable) or with every
rank in this process (``simulate_adapter``; ``verify_adapter`` checks every consumer gets exactly
its region, against values sliced from full tensors, not computed by the steps).
``reduce_gradients`` likewise runs the gradient buckets as ``reduce`` instructions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssdsl.ir.region import Region
from ssdsl.lower import localize, run_all
from ssdsl.lower.instr import Comm, ReduceBucket
from ssdsl.lower.walk import Exchange
from ssdsl.materialize.steps import Adapter
from ssdsl.runtime.comm import combine
from ssdsl.runtime.executor import DistRunner, RankState, Runner
from ssdsl.runtime.groups import ProcessGroups
from ssdsl.runtime.simulate import SimRunner

Local = torch.Tensor | Sequence[torch.Tensor] | None


def adapter_comm(adapter: Adapter, rank: int, *, tag: int = 0, backward: bool = False) -> Comm:
    """The ``comm`` instruction of ``rank`` in ``adapter`` (``backward``: in its gradient
    adapter, named as a program names it: inputs ``in<i>``, outputs ``out<i>``)."""
    ad = adapter.backward if backward else adapter
    ins = tuple(f"in{i}" for i, (d, _) in enumerate(_mine(adapter.producers, rank)))
    outs = tuple(f"out{i}" for i, (d, _) in enumerate(_mine(adapter.consumers, rank)))
    dtype = "float" if adapter.dtype.is_floating_point else str(adapter.dtype).split(".")[-1]
    if backward:
        shapes = tuple(r.local_shape for _, r in _mine(adapter.consumers, rank))
        return Comm(0, 0, True, outs, ins, shapes, dtype, localize(ad, rank, 2 * tag + 1))
    shapes = tuple(r.local_shape for _, r in _mine(adapter.producers, rank))
    return Comm(0, 0, False, ins, outs, shapes, dtype, localize(ad, rank, 2 * tag))


def _mine(placements, rank: int):
    return [(d, r) for d, r in placements if d == rank]


def _drain(waits) -> None:
    for _ in waits or ():
        raise RuntimeError("a distributed runner never waits")


class _AdapterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: Runner, fwd: Comm, back: Comm | None, token: torch.Tensor,
                *inputs: torch.Tensor):
        ctx.runner, ctx.back, ctx.token, ctx.n = runner, back, token, len(inputs)
        runner.env = dict(zip(fwd.ins, inputs))
        _drain(runner.on_comm(fwd))
        outs = tuple(runner.env[o].detach() for o in fwd.outs)
        if outs and not outs[0].is_floating_point():
            ctx.mark_non_differentiable(*outs)
        return outs if outs else (token.new_empty(0),)

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.back
        if back is None:
            raise RuntimeError("this adapter was planned without a backward (backward=False)")
        runner = ctx.runner
        runner.grads = {v: g for v, g in zip(back.ins, grads) if g is not None}
        _drain(runner.on_comm(back))
        res = [runner.grads.get(v) for v in back.outs]
        return (None, None, None, torch.zeros_like(ctx.token), *res[:ctx.n])


def run_adapter(adapter: Adapter, rank: int, local: Local, *,
                groups: ProcessGroups | None = None,
                tag: int = 0) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """Run ``adapter`` for ``rank`` on torch.distributed; differentiable (backward runs the
    gradient adapter).

    ``local``: this rank's producer tensors (one per producer placement on it; a single tensor
    when there is one; ``None`` when there is none). Returns its consumer tensor(s); a rank that
    only produces gets an empty *token* to include in its backward (so that the gradients sent
    to it are received); ``None`` for a rank outside the adapter.
    """
    if rank not in adapter.devices:
        return None
    inputs = [] if local is None else [local] if isinstance(local, torch.Tensor) else list(local)
    dtype = adapter.dtype if adapter.dtype.is_floating_point else torch.float32
    runner = DistRunner(rank, RankState({}, {}), dtype=dtype, groups=groups)
    fwd = adapter_comm(adapter, rank, tag=tag)
    back = adapter_comm(adapter, rank, tag=tag, backward=True) if adapter.backward else None
    token = torch.empty(0, dtype=dtype, requires_grad=True)
    outs = _AdapterFunction.apply(runner, fwd, back, token, *inputs)
    if len(fwd.outs) == 1:
        return outs[0]
    return outs if fwd.outs else outs[0]


def simulate_adapter(adapter: Adapter, locals: dict[int, torch.Tensor | Sequence[torch.Tensor]], *,
                     backward: bool = False) -> dict[int, torch.Tensor | list[torch.Tensor]]:
    """Run ``adapter`` (or its ``backward``) with every rank simulated in one process.

    ``locals`` maps each source device to its tensor (or list, one per slot); the result maps
    each target device to its tensor (a list when it has several slots)."""
    ad = adapter.backward if backward else adapter
    state = {d: [v] if isinstance(v, torch.Tensor) else list(v) for d, v in locals.items()}
    like = next(iter(state.values()))[0]
    exchange = Exchange(combine)
    runners, comms = {}, {}
    for rank in sorted(ad.devices):
        comm = adapter_comm(ad, rank)
        r = SimRunner(rank, RankState({}, {}), dtype=like.dtype if like.is_floating_point()
                      else torch.float32, exchange=exchange)
        r.env = dict(zip(comm.ins, state.get(rank, [])))
        runners[rank], comms[rank] = r, comm
    run_all({rank: iter(runners[rank].on_comm(comms[rank])) for rank in runners}, exchange)
    out = {}
    for rank, r in runners.items():
        got = [r.env[o] for o in comms[rank].outs]
        if got:
            out[rank] = got[0] if len(got) == 1 else got
    return out


def expected_values(adapter: Adapter, seed: int = 0) -> tuple[dict, dict[int, list[torch.Tensor]]]:
    """Random producer tensors for ``adapter`` and the value every consumer slot must get,
    computed by slicing full tensors directly (not by the adapter's steps).

    Each value part ``(k, V)`` present among the producers gets its own random full tensor; the
    logical value is the sum of the parts, where a part that no producer holds at a point adds 0.
    A consumer slot with a value part ``(k, V)``, V > 1, is returned as the *full* value: the
    verifier checks the parts of such consumers by their sum (``verify_adapter``).
    """
    gen = torch.Generator().manual_seed(seed)
    shape = adapter.shape
    parts = sorted({r.part for _, r in adapter.producers})
    fulls = {p: _random_full(shape, gen, adapter.dtype) for p in parts}
    # masks and the sum in float64, cast back once: a bool or integer tensor (an attention mask,
    # token ids) would otherwise be promoted to int64 by ``sum`` and compare as another dtype
    masks = {p: torch.zeros(shape, dtype=torch.float64) for p in parts}
    locals_: dict[int, list[torch.Tensor]] = {}
    for dev, reg in adapter.producers:
        locals_.setdefault(dev, []).append(reg.slice_of(fulls[reg.part]).clone())
        whole = torch.zeros(shape, dtype=torch.float64)
        Region.full(shape).add_into(whole, reg, torch.ones(reg.local_shape, dtype=torch.float64))
        masks[reg.part] = torch.maximum(masks[reg.part], whole)
    total = sum(fulls[p].to(torch.float64) * masks[p] for p in parts).to(adapter.dtype)
    expect: dict[int, list[torch.Tensor]] = {}
    for dev, reg in adapter.consumers:
        expect.setdefault(dev, []).append(reg.slice_of(total))
    return locals_, expect


def _random_full(shape, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random values of ``dtype`` that differ from point to point (bools both ways, integers
    small), so that a region sent to the wrong place shows."""
    if dtype == torch.bool:
        return torch.randn(shape, generator=gen) > 0
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-50, 50, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _close(value: torch.Tensor, want: torch.Tensor, atol: float) -> bool:
    """Equal values of equal dtype; floating values within ``atol``."""
    if value.dtype != want.dtype:
        return False
    if not value.dtype.is_floating_point:
        return torch.equal(value, want)
    return torch.allclose(value, want, atol=atol)


def verify_adapter(adapter: Adapter, *, seed: int = 0, atol: float = 1e-5) -> list[str]:
    """Run ``adapter`` on random data with simulated ranks; return the problems found (empty: the
    adapter gives every consumer exactly the values of its region).

    A consumer holding value part ``(k, V)`` is checked through its group: one holder of each
    ``k`` of the same region must sum to the value (replicas of a part are not counted twice).
    """
    locals_, expect = expected_values(adapter, seed)
    try:
        got = simulate_adapter(adapter, locals_)
    except (RuntimeError, ValueError, IndexError) as err:  # steps that do not fit the data
        return [f"the steps fail on the producers' data: {err}"]
    got = {d: [v] if isinstance(v, torch.Tensor) else list(v) for d, v in got.items()}
    problems: list[str] = []
    partial: dict[tuple, dict[int, torch.Tensor]] = {}
    slots: dict[int, int] = {}
    for dev, reg in adapter.consumers:
        slot = slots.get(dev, 0)
        slots[dev] = slot + 1
        held = got.get(dev, [])
        value = held[slot] if slot < len(held) else None
        want = expect[dev][slot]
        if value is None or tuple(value.shape) != reg.local_shape:
            problems.append(f"device {dev} slot {slot}: no tensor of shape {reg.local_shape}")
        elif reg.part[1] > 1:
            partial.setdefault((reg.intervals, reg.part[1]), {}).setdefault(reg.part[0], value)
            partial[(reg.intervals, reg.part[1])].setdefault(-1, want)
        elif not _close(value, want, atol):
            error = (value.double() - want.double()).abs().max().item()
            problems.append(f"device {dev} slot {slot} ({reg!r}): wrong values, max error "
                            f"{error:.3g}")
    for (ivs, v), by_k in partial.items():
        want = by_k.pop(-1)
        if len(by_k) == v and not _close(sum(by_k.values()), want, atol):
            problems.append(f"the {v} value parts of {ivs} do not sum to the value")
    return problems


def reduce_gradients(reducer, rank: int, grads: dict, *, groups: ProcessGroups | None = None,
                     simulate: dict[int, dict] | None = None) -> None:
    """Sum, in place, the gradients of every bucket that ``rank`` is in, as ``reduce``
    instructions do. ``grads`` maps ``(weight name, Region)`` to this rank's gradient; with
    ``simulate`` (device -> such a dict, every device at once) no process group is used."""
    buckets = [(i, b) for i, b in enumerate(reducer.buckets)]
    if simulate is None:
        state = _grad_state(grads)
        runner = DistRunner(rank, state, dtype=torch.float64, groups=groups)
        for i, b in buckets:
            if rank in b.devices:
                _drain(runner.on_reduce(ReduceBucket(i, tuple(b.devices), tuple(b.entries))))
        _back_into(state, grads)
        return
    exchange = Exchange(combine)
    walks, states = {}, {}
    for d, mine in simulate.items():
        states[d] = _grad_state(mine)
        runner = SimRunner(d, states[d], dtype=torch.float64, exchange=exchange)
        walks[d] = _reduce_all(runner, [(i, b) for i, b in buckets if d in b.devices])
    run_all(walks, exchange)
    for d, mine in simulate.items():
        _back_into(states[d], mine)


def _back_into(state: RankState, grads: dict) -> None:
    """The reduced gradients into the caller's tensors: the reduce handler may leave a leaf's
    ``.grad`` a view of the reduced buffer instead of writing into the tensor it had."""
    for key, g in grads.items():
        reduced = state.leaves[key].grad
        if reduced is not g:
            g.copy_(reduced)


def _grad_state(grads: dict) -> RankState:
    """Leaves whose ``.grad`` are the given tensors (the reduce handler sums them)."""
    leaves = {}
    for key, g in grads.items():
        leaf = torch.zeros_like(g)
        leaf.grad = g
        leaves[key] = leaf
    return RankState(leaves, {})


def _reduce_all(runner: Runner, buckets):
    for i, b in buckets:
        yield from runner.on_reduce(ReduceBucket(i, tuple(b.devices), tuple(b.entries)))
