"""The regular path: cheapest chain of one-step RVD transitions between two layouts.

The search runs over signatures ``(R, V, D_0, ...)`` only (nnScaler's RVD graph): its result
depends on the shape, the item size and the two signatures, never on device ids, so it is cached
and shared by every device group of the same shape. The chain is then *realised* on the source
layout's device grid, which names the groups of every step; where a step leaves a free choice
(which replica takes which chunk) the target layout's device grid decides it, so that the result
usually lands on the target exactly. When it does not, the caller appends a point-to-point fix-up.

Transitions, each by a factor ``k`` dividing the axis it shrinks (cost: ``steps.py``):
D_i -> R all-gather, V -> R all-reduce, V -> D_j reduce-scatter, D_i -> D_j all-to-all,
R -> D_j local chunk, R -> V local zero-split.
"""

from __future__ import annotations

import functools
import heapq
import math

import attrs
import numpy as np

from ssdsl.ir.layout import Layout
from ssdsl.materialize.steps import (AllGather, AllReduce, AllToAll, Chunk, CollectiveStep,
                                     ReduceScatter, ZeroSplit)

Sig = tuple[int, ...]
R_AX, V_AX = 0, 1


@attrs.frozen
class Move:
    """One abstract transition: ``kind`` by factor ``k`` from axis ``src`` to axis ``dst``
    (axes of the mesh ``(R, V, D_0, ...)``)."""

    kind: str
    src: int
    dst: int
    k: int


def _divisors(n: int) -> list[int]:
    return [k for k in range(2, n + 1) if n % k == 0]


def _moves(sig: Sig, shape: tuple[int, ...]) -> list[tuple[Move, Sig, int]]:
    """Every transition from ``sig``: ``(move, next signature, bytes as a multiple of the local
    element count)``; the byte multiple is per the whole mesh."""
    n = math.prod(sig)
    out = []
    ndim = len(shape)

    def go(kind: str, src: int, dst: int, k: int, cost: int) -> None:
        nxt = list(sig)
        nxt[src] //= k
        nxt[dst] *= k
        if dst >= 2 and (shape[dst - 2] % nxt[dst]):
            return
        out.append((Move(kind, src, dst, k), tuple(nxt), cost))

    for i in range(ndim):
        for k in _divisors(sig[2 + i]):
            go("all_gather", 2 + i, R_AX, k, n * (k - 1))
            for j in range(ndim):
                if j != i:
                    go("all_to_all", 2 + i, 2 + j, k, n * (k - 1) // k)
    for k in _divisors(sig[V_AX]):
        go("all_reduce", V_AX, R_AX, k, 2 * n * (k - 1) // k)
        for j in range(ndim):
            go("reduce_scatter", V_AX, 2 + j, k, n * (k - 1) // k)
    for k in _divisors(sig[R_AX]):
        go("zero_split", R_AX, V_AX, k, 0)
        for j in range(ndim):
            go("chunk", R_AX, 2 + j, k, 0)
    return out


def _local_numel(sig: Sig, shape: tuple[int, ...]) -> int:
    return math.prod(shape) // math.prod(sig[2:])


@functools.lru_cache(maxsize=4096)
def search(shape: tuple[int, ...], itemsize: int, src: Sig, dst: Sig) -> tuple[tuple[Move, ...], int] | None:
    """The cheapest chain of moves from signature ``src`` to ``dst`` and its bytes, ties broken by
    fewer steps; ``None`` when no chain exists (a split that does not divide)."""
    if math.prod(src) != math.prod(dst):
        return None
    frontier: list[tuple[int, int, Sig, tuple[Move, ...]]] = [(0, 0, src, ())]
    best: dict[Sig, tuple[int, int]] = {src: (0, 0)}
    while frontier:
        cost, nsteps, sig, path = heapq.heappop(frontier)
        if sig == dst:
            return path, cost
        if best.get(sig, (cost, nsteps)) < (cost, nsteps):
            continue
        local = _local_numel(sig, shape) * itemsize
        for move, nxt, mult in _moves(sig, shape):
            key = (cost + mult * local, nsteps + 1)
            if key < best.get(nxt, (1 << 62, 0)):
                best[nxt] = key
                heapq.heappush(frontier, (*key, nxt, (*path, move)))
    return None


# -- realisation on a device grid ------------------------------------------------------------------


def _split_axis(a: np.ndarray, axis: int, k: int) -> np.ndarray:
    """Axis ``axis`` of size ``q*k`` becomes ``(q, k)``: index ``q*k + m`` goes to ``(q, m)``."""
    s = list(a.shape)
    return a.reshape(s[:axis] + [s[axis] // k, k] + s[axis + 1:])


def _merge_after(b: np.ndarray, k_axis: int, dst: int) -> np.ndarray:
    """Move the ``k`` axis right after mesh axis ``dst`` (an index among the axes other than k,
    which keep their order) and merge it into that axis as the minor factor: index ``x*k + m``."""
    moved = np.moveaxis(b, k_axis, dst + 1)
    s = list(moved.shape)
    return moved.reshape(s[:dst] + [s[dst] * s[dst + 1]] + s[dst + 2:])


def _groups(b: np.ndarray, k_axis: int) -> tuple[tuple[int, ...], ...]:
    flat = np.moveaxis(b, k_axis, -1).reshape(-1, b.shape[k_axis])
    return tuple(tuple(int(x) for x in row) for row in flat)


def _target_rank(target: Layout | None, axis: int, new_size: int) -> dict[int, int]:
    """For each device of ``target``, its block index along mesh ``axis`` at resolution
    ``new_size`` (when the target splits that axis into a multiple of ``new_size``)."""
    if target is None:
        return {}
    size = target.mesh_shape[axis]
    if size % new_size:
        return {}
    arr = target.array()
    idx = np.indices(arr.shape)[axis]
    return {int(d): int(i) // (size // new_size) for d, i in zip(arr.reshape(-1), idx.reshape(-1))}


def _arrange_replicas(a: np.ndarray, k: int, want: dict[int, int]) -> np.ndarray:
    """Reorder the R axis so that after splitting it into ``(q, k)`` each device's ``m`` is its
    wanted chunk ``want[d] % k`` where that can be done for every block; else keep the order."""
    if not want:
        return a
    r = a.shape[0]
    flat = a.reshape(r, -1)
    out = flat.copy()
    for col in range(flat.shape[1]):
        buckets: list[list[int]] = [[] for _ in range(k)]
        for dev in flat[:, col]:
            m = want.get(int(dev))
            if m is None:
                return a
            buckets[m % k].append(int(dev))
        if any(len(b) != r // k for b in buckets):
            return a
        out[:, col] = [buckets[m][q] for q in range(r // k) for m in range(k)]
    return out.reshape(a.shape)


def realise(move: Move, a: np.ndarray, shape: tuple[int, ...], itemsize: int,
            target: Layout | None) -> tuple[CollectiveStep, np.ndarray]:
    """Apply ``move`` to grid ``a`` (axes ``(R, V, D...)``): the step with its groups, and the new grid."""
    local = _local_numel(a.shape, shape) * itemsize
    k, n = move.k, a.size
    if move.src == R_AX:  # local: the target decides which replica takes which piece
        new_size = a.shape[move.dst] * k
        a = _arrange_replicas(a, k, _target_rank(target, move.dst, new_size))
    b = _split_axis(a, move.src, k)
    groups = _groups(b, move.src + 1)
    new = _merge_after(b, move.src + 1, move.dst)
    step = _step(move, groups, n, local, len(shape))
    return step, new


def _step(move: Move, groups, n: int, local: int, ndim: int) -> CollectiveStep:
    k, dim = move.k, move.dst - 2
    if move.kind == "all_gather":
        return AllGather(groups, n * (k - 1) * local, dim=move.src - 2)
    if move.kind == "all_reduce":
        return AllReduce(groups, 2 * n * (k - 1) * local // k)
    if move.kind == "reduce_scatter":
        return ReduceScatter(groups, n * (k - 1) * local // k, dim=dim)
    if move.kind == "all_to_all":
        return AllToAll(groups, n * (k - 1) * local // k, cat_dim=move.src - 2, split_dim=dim)
    if move.kind == "chunk":
        return Chunk(groups, 0, dim=dim)
    return ZeroSplit(groups, 0)


def plan_regular(src: Layout, dst: Layout, itemsize: int) -> tuple[list[CollectiveStep], Layout] | None:
    """Steps from ``src`` to ``dst`` (same devices) and the layout they reach, or ``None``."""
    found = search(src.shape, itemsize, src.signature, dst.signature)
    if found is None:
        return None
    a = src.array()
    steps = []
    for move in found[0]:
        step, a = realise(move, a, src.shape, itemsize, dst)
        steps.append(step)
    return steps, Layout.from_array(src.shape, a)
