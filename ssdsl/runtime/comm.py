"""Executing adapters: on torch.distributed for one rank, or for all ranks in one process.

``run_adapter(adapter, rank, local, groups=...)`` runs the adapter's steps for ``rank`` inside one
autograd function whose backward runs ``adapter.backward`` (the gradient adapter that
``plan_adapter`` derived), so the per-rank forward is differentiable. ``simulate_adapter`` runs the
same step list with every rank simulated in one process: it is the verifier, and the reference
the distributed executor is tested against.

The differentiable primitives (``all_gather`` ... ``recv``) are also offered one by one, each with
its dual as backward: all-gather / reduce-scatter, reduce-scatter / all-gather, all-reduce /
identity, identity / all-reduce (``reduce_grad``), chunk / all-gather, all-to-all / the reverse
all-to-all, send / recv.

A *group* is an ordered tuple of ranks: position ``m`` in it is the chunk index (all-gather
concatenates in group order, reduce-scatter and chunk give member ``m`` chunk ``m``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ssdsl.ir.region import Region
from ssdsl.materialize.steps import (Adapter, AllGather, AllReduce, AllToAll, Chunk, PointToPoint,
                                     ReduceScatter, Step, ZeroSplit)
from ssdsl.runtime.groups import ProcessGroups

Members = tuple[int, ...]
Local = torch.Tensor | Sequence[torch.Tensor] | None

# -- raw collectives for one rank (no autograd) -----------------------------------------------------


def _pg(groups: ProcessGroups | None, members: Members):
    return groups.get(members) if groups is not None else None


def _by_member(members: Members, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reorder outputs listed in ascending rank (torch's group order) into ``members`` order."""
    by = dict(zip(sorted(members), outs))
    return [by[m] for m in members]


def raw_all_gather(x: torch.Tensor, members: Members, dim: int, groups=None) -> torch.Tensor:
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in members]
    dist.all_gather(outs, x.contiguous(), group=_pg(groups, members))
    return torch.cat(_by_member(members, outs), dim)


def raw_all_reduce(x: torch.Tensor, members: Members, groups=None) -> torch.Tensor:
    y = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(y, group=_pg(groups, members))
    return y


def raw_reduce_scatter(x: torch.Tensor, members: Members, dim: int, rank: int,
                       groups=None) -> torch.Tensor:
    chunks = x.chunk(len(members), dim)
    pos = {m: i for i, m in enumerate(members)}
    inputs = [chunks[pos[m]].contiguous() for m in sorted(members)]
    out = torch.empty_like(inputs[0])
    dist.reduce_scatter(out, inputs, group=_pg(groups, members))
    return out


def raw_all_to_all(x: torch.Tensor, members: Members, cat_dim: int, split_dim: int,
                   groups=None) -> torch.Tensor:
    chunks = x.chunk(len(members), split_dim)
    pos = {m: i for i, m in enumerate(members)}
    inputs = [chunks[pos[m]].contiguous() for m in sorted(members)]
    outs = [torch.empty_like(t) for t in inputs]
    dist.all_to_all(outs, inputs, group=_pg(groups, members))
    return torch.cat(_by_member(members, outs), cat_dim)


def raw_chunk(x: torch.Tensor, members: Members, dim: int, rank: int) -> torch.Tensor:
    return x.chunk(len(members), dim)[members.index(rank)].clone()


# -- step execution -----------------------------------------------------------------------------


def _my_group(step, rank: int) -> Members | None:
    for g in step.groups:
        if rank in g:
            return g
    return None


def _run_collective(step, rank: int, x: torch.Tensor, groups) -> torch.Tensor:
    g = _my_group(step, rank)
    if g is None:
        return x
    if isinstance(step, AllGather):
        return raw_all_gather(x, g, step.dim, groups)
    if isinstance(step, AllReduce):
        return raw_all_reduce(x, g, groups)
    if isinstance(step, ReduceScatter):
        return raw_reduce_scatter(x, g, step.dim, rank, groups)
    if isinstance(step, AllToAll):
        return raw_all_to_all(x, g, step.cat_dim, step.split_dim, groups)
    if isinstance(step, Chunk):
        return raw_chunk(x, g, step.dim, rank)
    if isinstance(step, ZeroSplit):
        return x if g.index(rank) == 0 else torch.zeros_like(x)
    raise TypeError(f"unknown step {step!r}")


def _slot_regions(placements, rank: int):
    return [reg for dev, reg in placements if dev == rank]


# Sends never block (the checker's ASYNC model: 1F1B deadlocks with blocking sends); their requests
# wait here, with the buffers they read, until ``wait_sends`` (at the latest when a step ends).
_PENDING_SENDS: list[tuple[object, torch.Tensor]] = []
# Messages of one step get tags ``tag * 2 * TAG_STRIDE + direction * TAG_STRIDE + index``: a
# caller's ``tag`` (one per adapter and micro-batch) keeps messages in flight at the same time
# from matching each other's receives.
TAG_STRIDE = 4096


def wait_sends() -> int:
    """Wait for every send still in flight; returns how many there were."""
    n = len(_PENDING_SENDS)
    for req, _buf in _PENDING_SENDS:
        req.wait()
    _PENDING_SENDS.clear()
    return n


def _run_p2p(step: PointToPoint, rank: int, held: list[torch.Tensor],
             like: torch.Tensor, tag: int = 0) -> list[torch.Tensor]:
    src_regions = _slot_regions(step.sources, rank)
    dst_regions = _slot_regions(step.targets, rank)
    outs = [torch.zeros(r.local_shape, dtype=like.dtype, device=like.device) for r in dst_regions]
    if len(step.messages) > TAG_STRIDE:
        raise ValueError(f"a point-to-point step of {len(step.messages)} messages (at most "
                         f"{TAG_STRIDE})")
    recvs = []
    for i, msg in enumerate(step.messages):
        if msg.src == rank and msg.dst == rank:
            piece = src_regions[msg.src_slot].extract(held[msg.src_slot], msg.region)
            dst_regions[msg.dst_slot].add_into(outs[msg.dst_slot], msg.region, piece)
        elif msg.src == rank:
            piece = src_regions[msg.src_slot].extract(held[msg.src_slot], msg.region).contiguous()
            _PENDING_SENDS.append((dist.isend(piece, msg.dst, tag=tag + i), piece))
        elif msg.dst == rank:
            buf = torch.empty(msg.region.local_shape, dtype=like.dtype, device=like.device)
            recvs.append((msg, buf, dist.irecv(buf, msg.src, tag=tag + i)))
    for msg, buf, req in recvs:
        req.wait()
        dst_regions[msg.dst_slot].add_into(outs[msg.dst_slot], msg.region, buf)
    return outs


def run_steps(steps: Sequence[Step], rank: int, held: list[torch.Tensor], *,
              like: torch.Tensor, groups: ProcessGroups | None = None,
              tag: int = 0) -> list[torch.Tensor]:
    """Run ``steps`` for ``rank`` (no autograd): ``held`` are its slots before, the result after.

    ``tag``: the first message tag of point-to-point steps (see ``TAG_STRIDE``)."""
    for step in steps:
        if isinstance(step, PointToPoint):
            held = _run_p2p(step, rank, held, like, tag)
        elif held:
            held = [_run_collective(step, rank, held[0], groups)]
    return held


# -- the adapter as one autograd function ---------------------------------------------------------


class _AdapterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, adapter: Adapter, rank: int, groups, tag: int, like: torch.Tensor, *inputs):
        ctx.adapter, ctx.rank, ctx.groups, ctx.n_in = adapter, rank, groups, len(inputs)
        ctx.tag = tag
        ctx.like = torch.empty(0, dtype=like.dtype, device=like.device)
        outs = run_steps(adapter.steps, rank, list(inputs), like=like, groups=groups,
                         tag=_tag(tag, 0))
        ctx.out_shapes = [tuple(o.shape) for o in outs]
        return tuple(outs) if outs else (like.new_empty(0),)

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.adapter.backward
        if back is None:
            raise RuntimeError("this adapter was planned without a backward (backward=False)")
        held = [g if g is not None else ctx.like.new_zeros(s)
                for g, s in zip(grads, ctx.out_shapes)]
        res = run_steps(back.steps, ctx.rank, held, like=ctx.like, groups=ctx.groups,
                        tag=_tag(ctx.tag, 1))
        res = list(res) + [None] * (ctx.n_in - len(res))
        return (None, None, None, None, None, *res[: ctx.n_in])


def _tag(tag: int, direction: int) -> int:
    return (2 * tag + direction) * TAG_STRIDE


def run_adapter(adapter: Adapter, rank: int, local: Local, *,
                groups: ProcessGroups | None = None,
                tag: int = 0) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """Run ``adapter`` for ``rank`` on torch.distributed; differentiable.

    ``local``: this rank's producer tensors (one per producer placement on it, in order; a
    single tensor when there is one; ``None`` when there is none). Returns its consumer tensor(s)
    likewise; a rank that only produces gets an empty *token* tensor, which the caller must
    include in its backward (``torch.autograd.backward([token], [token.new_empty(0)])``) so that
    the gradients sent to it are received; ``None`` for a rank outside the adapter. Every rank of
    the adapter must call this, in the same order relative to other adapters' collectives.
    ``tag`` tells apart the messages of adapters in flight at once (pipelines: one per edge and
    micro-batch); sends return at once and complete by ``wait_sends``.
    """
    if rank not in adapter.devices:
        return None
    inputs = [] if local is None else [local] if isinstance(local, torch.Tensor) else list(local)
    like = inputs[0] if inputs else torch.empty(
        0, dtype=adapter.dtype, requires_grad=adapter.dtype.is_floating_point)
    args = inputs if inputs else [like]
    n_out = sum(1 for d, _ in adapter.consumers if d == rank)
    if not inputs:
        # a consumer-only rank: the token input makes autograd call our backward (it sends grads)
        outs = _ConsumerOnly.apply(adapter, rank, groups, tag, like)
    else:
        outs = _AdapterFunction.apply(adapter, rank, groups, tag, like.detach(), *args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if n_out == 1:
        return outs[0]
    return outs if n_out else outs[0]


class _ConsumerOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, adapter: Adapter, rank: int, groups, tag: int, token: torch.Tensor):
        ctx.adapter, ctx.rank, ctx.groups, ctx.tag = adapter, rank, groups, tag
        outs = run_steps(adapter.steps, rank, [], like=token, groups=groups, tag=_tag(tag, 0))
        ctx.out_shapes = [tuple(o.shape) for o in outs]
        ctx.dtype = token.dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        held = [g if g is not None else torch.zeros(s, dtype=ctx.dtype)
                for g, s in zip(grads, ctx.out_shapes)]
        run_steps(ctx.adapter.backward.steps, ctx.rank, held, like=held[0], groups=ctx.groups,
                  tag=_tag(ctx.tag, 1))
        return None, None, None, None, torch.zeros(0, dtype=ctx.dtype)


# -- localized steps (``ssdsl.lower.instr.Coll``) ------------------------------------------------


def coll_on_rank(coll, rank: int, x: torch.Tensor, groups: ProcessGroups | None) -> torch.Tensor:
    """Run one localized collective ``coll`` (kind, group, dims) for ``rank`` on
    torch.distributed; chunk and zero-split are local."""
    g = coll.group
    if coll.kind == "all_gather":
        return raw_all_gather(x, g, coll.dim, groups) if len(g) > 1 else x
    if coll.kind == "all_reduce":
        return raw_all_reduce(x, g, groups) if len(g) > 1 else x
    if coll.kind == "reduce_scatter":
        return raw_reduce_scatter(x, g, coll.dim, rank, groups) if len(g) > 1 else x
    if coll.kind == "all_to_all":
        return raw_all_to_all(x, g, coll.cat_dim, coll.split_dim, groups) if len(g) > 1 else x
    return local_coll(coll, rank, x)


def local_coll(coll, rank: int, x: torch.Tensor) -> torch.Tensor:
    """A collective that moves nothing: chunk, zero-split, or any kind over a group of one."""
    if coll.kind == "chunk":
        return raw_chunk(x, coll.group, coll.dim, rank)
    if coll.kind == "zero_split":
        return x if coll.group.index(rank) == 0 else torch.zeros_like(x)
    if len(coll.group) == 1:
        return x
    raise ValueError(f"{coll.kind} over {coll.group} moves data")


def combine(coll, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every member's result of collective ``coll``, from every member's input (group order):
    the in-process simulation of one meeting."""
    g = coll.group
    if coll.kind == "all_gather":
        ys = [torch.cat(xs, coll.dim)] * len(g)
    elif coll.kind == "all_reduce":
        ys = [torch.stack(xs).sum(0)] * len(g)
    elif coll.kind == "reduce_scatter":
        ys = list(torch.stack(xs).sum(0).chunk(len(g), coll.dim))
    elif coll.kind == "all_to_all":
        parts = [x.chunk(len(g), coll.split_dim) for x in xs]
        ys = [torch.cat([p[m] for p in parts], coll.cat_dim) for m in range(len(g))]
    else:
        ys = [local_coll(coll, r, x) for r, x in zip(g, xs)]
    return [y.clone() for y in ys]


def isend(piece: torch.Tensor, peer: int, tag: int) -> None:
    """A send that never blocks; it completes by ``wait_sends``."""
    _PENDING_SENDS.append((dist.isend(piece, peer, tag=tag), piece))


# -- simulation of every rank in one process (the verifier) -------------------------------------


def _sim_collective(step, state: dict[int, list[torch.Tensor]]) -> None:
    for g in step.groups:
        xs = [state[m][0] for m in g]
        if isinstance(step, AllGather):
            ys = [torch.cat(xs, step.dim)] * len(g)
        elif isinstance(step, AllReduce):
            ys = [torch.stack(xs).sum(0)] * len(g)
        elif isinstance(step, ReduceScatter):
            ys = list(torch.stack(xs).sum(0).chunk(len(g), step.dim))
        elif isinstance(step, AllToAll):
            parts = [x.chunk(len(g), step.split_dim) for x in xs]
            ys = [torch.cat([p[m] for p in parts], step.cat_dim) for m in range(len(g))]
        elif isinstance(step, Chunk):
            ys = [x.chunk(len(g), step.dim)[m] for m, x in enumerate(xs)]
        elif isinstance(step, ZeroSplit):
            ys = [xs[0]] + [torch.zeros_like(x) for x in xs[1:]]
        else:
            raise TypeError(f"unknown step {step!r}")
        for m, y in zip(g, ys):
            state[m] = [y.clone()]


def _sim_p2p(step: PointToPoint, state: dict[int, list[torch.Tensor]], like: torch.Tensor):
    out: dict[int, list[torch.Tensor]] = {}
    for dev, reg in step.targets:
        out.setdefault(dev, []).append(torch.zeros(reg.local_shape, dtype=like.dtype))
    src = {d: _slot_regions(step.sources, d) for d, _ in step.sources}
    dst = {d: _slot_regions(step.targets, d) for d, _ in step.targets}
    for msg in step.messages:
        piece = src[msg.src][msg.src_slot].extract(state[msg.src][msg.src_slot], msg.region)
        dst[msg.dst][msg.dst_slot].add_into(out[msg.dst][msg.dst_slot], msg.region, piece)
    return out


def simulate_steps(steps: Sequence[Step], state: dict[int, list[torch.Tensor]],
                   like: torch.Tensor) -> dict[int, list[torch.Tensor]]:
    """Run ``steps`` for every device at once: ``state`` maps a device to its slots."""
    state = {d: list(v) for d, v in state.items()}
    for step in steps:
        if isinstance(step, PointToPoint):
            state = _sim_p2p(step, state, like)
        else:
            _sim_collective(step, state)
    return state


def simulate_adapter(adapter: Adapter, locals: dict[int, torch.Tensor | Sequence[torch.Tensor]], *,
                     backward: bool = False) -> dict[int, torch.Tensor | list[torch.Tensor]]:
    """Run ``adapter`` (or its ``backward``) with every rank simulated in one process.

    ``locals`` maps each source device to its tensor (or list of tensors, one per slot); the
    result maps each target device to its tensor (a list when it has several slots).
    """
    ad = adapter.backward if backward else adapter
    state = {d: [v] if isinstance(v, torch.Tensor) else list(v) for d, v in locals.items()}
    like = next(iter(state.values()))[0]
    out = simulate_steps(ad.steps, state, like)
    targets = {d for d, _ in ad.consumers}
    return {d: v[0] if len(v) == 1 else v for d, v in out.items() if d in targets}


# -- differentiable primitives, each with its dual as backward --------------------------------------


class _Dual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd: Callable, bwd: Callable, x: torch.Tensor):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return None, None, ctx.bwd(g.contiguous())


def all_gather(x: torch.Tensor, members: Members, rank: int, *, dim: int, groups=None) -> torch.Tensor:
    """D -> R; backward reduce-scatter (each replica's gradient is a contribution)."""
    return _Dual.apply(lambda t: raw_all_gather(t, members, dim, groups),
                       lambda g: raw_reduce_scatter(g, members, dim, rank, groups), x)


def reduce_scatter(x: torch.Tensor, members: Members, rank: int, *, dim: int,
                   groups=None) -> torch.Tensor:
    """V -> D; backward all-gather."""
    return _Dual.apply(lambda t: raw_reduce_scatter(t, members, dim, rank, groups),
                       lambda g: raw_all_gather(g, members, dim, groups), x)


def all_reduce(x: torch.Tensor, members: Members, *, groups=None) -> torch.Tensor:
    """V -> R; backward identity (Megatron's g)."""
    return _Dual.apply(lambda t: raw_all_reduce(t, members, groups), lambda g: g, x)


def reduce_grad(x: torch.Tensor, members: Members, *, groups=None) -> torch.Tensor:
    """Identity; backward all-reduce (Megatron's f: replicas whose gradients are contributions)."""
    return _Dual.apply(lambda t: t.clone(), lambda g: raw_all_reduce(g, members, groups), x)


def chunk(x: torch.Tensor, members: Members, rank: int, *, dim: int, groups=None) -> torch.Tensor:
    """R -> D (local); backward all-gather."""
    return _Dual.apply(lambda t: raw_chunk(t, members, dim, rank),
                       lambda g: raw_all_gather(g, members, dim, groups), x)


def all_to_all(x: torch.Tensor, members: Members, *, cat_dim: int, split_dim: int,
               groups=None) -> torch.Tensor:
    """D(split_dim... ) -> D(...): split ``split_dim``, concatenate ``cat_dim``; backward the reverse."""
    return _Dual.apply(lambda t: raw_all_to_all(t, members, cat_dim, split_dim, groups),
                       lambda g: raw_all_to_all(g, members, split_dim, cat_dim, groups), x)


def send(x: torch.Tensor, dst: int) -> torch.Tensor:
    """Send ``x``; returns an empty token whose backward receives the gradient of ``x``."""
    return _Send.apply(x, dst)


def recv(shape: Sequence[int], src: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Receive a tensor; its backward sends the gradient back to ``src``."""
    token = torch.empty(0, dtype=dtype, requires_grad=True)
    return _Recv.apply(token, tuple(shape), src)


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dst):
        ctx.dst, ctx.shape, ctx.dtype = dst, x.shape, x.dtype
        dist.send(x.contiguous(), dst)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _g):
        g = torch.empty(ctx.shape, dtype=ctx.dtype)
        dist.recv(g, ctx.dst)
        return g, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, shape, src):
        ctx.src = src
        buf = torch.empty(shape, dtype=token.dtype)
        dist.recv(buf, src)
        return buf

    @staticmethod
    def backward(ctx, g):
        dist.send(g.contiguous(), ctx.src)
        return torch.zeros(0, dtype=g.dtype), None, None


# -- the verifier -------------------------------------------------------------------------------


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
    fulls = {p: torch.randn(shape, generator=gen, dtype=torch.float64).to(adapter.dtype)
             for p in parts}
    masks = {p: torch.zeros(shape, dtype=adapter.dtype) for p in parts}
    locals_: dict[int, list[torch.Tensor]] = {}
    for dev, reg in adapter.producers:
        locals_.setdefault(dev, []).append(reg.slice_of(fulls[reg.part]).clone())
        whole = torch.zeros(shape, dtype=adapter.dtype)
        Region.full(shape).add_into(whole, reg, torch.ones(reg.local_shape, dtype=adapter.dtype))
        masks[reg.part] = torch.maximum(masks[reg.part], whole)
    total = sum(fulls[p] * masks[p] for p in parts)
    expect: dict[int, list[torch.Tensor]] = {}
    for dev, reg in adapter.consumers:
        expect.setdefault(dev, []).append(reg.slice_of(total))
    return locals_, expect


def verify_adapter(adapter: Adapter, *, seed: int = 0, atol: float = 1e-5) -> list[str]:
    """Run ``adapter`` on random data with simulated ranks; return the problems found (empty: the
    adapter gives every consumer exactly the values of its region).

    A consumer holding value part ``(k, V)`` is checked through its group: one holder of each
    ``k`` of the same region must sum to the value (replicas of a part are not counted twice).
    """
    locals_, expect = expected_values(adapter, seed)
    like = next(iter(locals_.values()))[0]
    got = simulate_steps(adapter.steps, locals_, like)
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
        elif not torch.allclose(value, want, atol=atol):
            problems.append(f"device {dev} slot {slot} ({reg!r}): wrong values, max error "
                            f"{(value - want).abs().max().item():.3g}")
    for (ivs, v), by_k in partial.items():
        want = by_k.pop(-1)
        if len(by_k) == v and not torch.allclose(sum(by_k.values()), want, atol=atol):
            problems.append(f"the {v} value parts of {ivs} do not sum to the value")
    return problems


# -- weight-gradient reducers -------------------------------------------------------------------


def reduce_gradients(reducer, rank: int, grads: dict, *, groups: ProcessGroups | None = None,
                     simulate: dict[int, dict] | None = None) -> None:
    """Sum, in place, the gradients of every bucket that ``rank`` is in.

    ``grads`` maps ``(weight name, Region)`` to this rank's gradient tensor of that region. With
    ``simulate`` (device -> such a dict, every device at once) no process group is used.
    """
    if simulate is not None:
        for b in reducer.buckets:
            total = [sum(simulate[d][e] for d in b.devices) for e in b.entries]
            for d in b.devices:
                for e, t in zip(b.entries, total):
                    simulate[d][e].copy_(t)
        return
    for b in reducer.buckets_of(rank):
        flat = torch.cat([grads[e].reshape(-1) for e in b.entries])
        dist.all_reduce(flat, group=_pg(groups, b.devices))
        offset = 0
        for e in b.entries:
            n = grads[e].numel()
            grads[e].copy_(flat[offset:offset + n].view_as(grads[e]))
            offset += n
