"""Communication primitives on torch.distributed, and their in-process simulation.

The raw collectives (``raw_all_gather`` ...) run one localized step of a program
(``coll_on_rank``; ``local_coll`` for chunk and zero-split); ``combine`` computes every member's
result of one collective in one process (the simulator's meeting); ``isend``/``wait_sends`` are
the non-blocking sends of point-to-point steps. Whole adapters run as program instructions
(``ssdsl.runtime.executor``; one adapter alone: ``ssdsl.runtime.adapters``).

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

from ssdsl.runtime import exchange
from ssdsl.runtime.groups import ProcessGroups

Members = tuple[int, ...]

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
    exchange.all_reduce(y, group=_pg(groups, members))
    return y


def raw_reduce_scatter(x: torch.Tensor, members: Members, dim: int, rank: int,
                       groups=None) -> torch.Tensor:
    chunks = x.chunk(len(members), dim)
    pos = {m: i for i, m in enumerate(members)}
    inputs = [chunks[pos[m]].contiguous() for m in sorted(members)]
    out = torch.empty_like(inputs[0])
    dist.reduce_scatter(out, inputs, group=_pg(groups, members))
    return out


def start_all_gather_into(out: torch.Tensor, x: torch.Tensor, members: Members, groups=None):
    """Start an all-gather of every member's ``x`` straight into the flat ``out`` (chunk ``m``
    of it from member ``m``; ``members`` ascending); the returned work completes it."""
    if list(members) != sorted(members):
        raise ValueError(f"a flat all-gather needs its members ascending, got {members}")
    # into one tensor: no copy out of a staging buffer (on gloo a third faster than a list)
    # (``all_gather_single`` is its name from torch 2.13 on: the old one warns it is deprecated)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, x, group=_pg(groups, members), async_op=True)


def start_reduce_scatter(out: torch.Tensor, x: torch.Tensor, members: Members, groups=None):
    """Start a reduce-scatter of the flat ``x`` (chunk ``m`` summed into member ``m``'s ``out``;
    ``members`` ascending); the returned work completes it."""
    if list(members) != sorted(members):
        raise ValueError(f"a flat reduce-scatter needs its members ascending, got {members}")
    # a list of views of ``x`` (no copies); on gloo it measured faster than reduce_scatter_tensor
    return dist.reduce_scatter(out, list(x.view(len(members), -1).unbind(0)),
                               group=_pg(groups, members), async_op=True)


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


# Sends never block (the checker's ASYNC model: 1F1B deadlocks with blocking sends); their requests
# wait here, with the buffers they read, until ``wait_sends`` (at the latest when a step ends).
_PENDING_SENDS: list[tuple[object, torch.Tensor]] = []


def wait_sends() -> int:
    """Wait for every send still in flight; returns how many there were."""
    n = len(_PENDING_SENDS)
    for req, _buf in _PENDING_SENDS:
        req.wait()
    _PENDING_SENDS.clear()
    return n


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


