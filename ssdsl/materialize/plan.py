"""``plan_adapter``: choose the communication between a tensor's producers and its consumers.

1. Same device set, both sides regular layouts (``Layout.from_placements``): the cheapest chain of
   RVD transitions (``rvd.py``); if its realisation does not land exactly on the consumers'
   grid, a point-to-point fix-up follows, unless plain point-to-point is cheaper.
2. Anything else (different device groups such as pipeline stages, uneven assignment, strided
   regions): point-to-point of exactly the overlapping regions (``p2p.py``), least volume.

A device that is both a producer and a consumer keeps its local data: collectives run on it in
place, and point-to-point copies what it already holds locally (no bytes). A consumer reads a
replicated value from its own device when it can, else from the least-loaded, nearest replica.

Gradients: ``backward`` is the adapter from the consumers' gradient placements to the
producers'. By default the gradient of a placement has the same index region and the full value
(the derivative of a sum with respect to each addend is the gradient of the sum), and replicated
consumers are taken to be replicas of one computation, each holding the whole gradient. A
consumer that computes only a contribution to the gradient of its input (an operator partitioned
along a dim the input lacks, or distinct operators reading the same value) must say so with a
value part in ``grad_consumers``; the backward adapter then sums the contributions. With these
defaults the backward of V->R all-reduce is nothing (identity), of R->D chunk an all-gather, of
V->D reduce-scatter an all-gather, of D->R all-gather a chunk (or a reduce-scatter when the
consumers declare partial gradients), of send a recv.

Plans are cached by (shape, dtype, placements with devices renamed 0..n-1 in sorted order), so
device groups of the same shape share one plan, renamed ("shifted").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ssdsl.ir.layout import Layout
from ssdsl.materialize.p2p import plan_p2p
from ssdsl.materialize.rvd import plan_regular
from ssdsl.ir.region import Region
from ssdsl.materialize.steps import Adapter, Message, Placement, PointToPoint, Step

_Placements = tuple[Placement, ...]


def full_value(placements: Sequence[Placement]) -> _Placements:
    """The default gradient placements: same regions, value parts dropped."""
    return tuple((d, r.with_part((0, 1))) for d, r in placements)


def plan_adapter(shape: Sequence[int], dtype: torch.dtype, producers: Sequence[Placement],
                 consumers: Sequence[Placement], *, grad_consumers: Sequence[Placement] | None = None,
                 grad_producers: Sequence[Placement] | None = None,
                 backward: bool = True) -> Adapter:
    """The adapter that gives every consumer placement the values of its region.

    ``producers`` / ``consumers``: ``(device, Region)``; a device's placements are its *slots*
    in list order (executors take and return one tensor per slot). ``grad_consumers`` /
    ``grad_producers`` default to ``full_value`` of the forward placements (module docstring).

    >>> from ssdsl.ir.layout import Layout
    >>> part = Layout.build((4, 8), [0, 1], v=2).placements()
    >>> full = Layout.build((4, 8), [0, 1], r=2).placements()
    >>> plan_adapter((4, 8), torch.float32, part, full).kinds
    ('all_reduce',)
    """
    shape = tuple(int(s) for s in shape)
    gc = tuple(grad_consumers) if grad_consumers is not None else full_value(consumers)
    gp = tuple(grad_producers) if grad_producers is not None else full_value(producers)
    devices = sorted({d for d, _ in (*producers, *consumers, *gc, *gp)})
    to_norm = {d: i for i, d in enumerate(devices)}
    norm = [tuple((to_norm[d], r) for d, r in pl) for pl in (producers, consumers, gc, gp)]
    adapter = _plan_normalized(shape, dtype, *norm, backward)
    return adapter.relabel(dict(enumerate(devices)))


@functools.lru_cache(maxsize=8192)
def _plan_normalized(shape: tuple[int, ...], dtype: torch.dtype, producers: _Placements,
                     consumers: _Placements, grad_consumers: _Placements,
                     grad_producers: _Placements, backward: bool) -> Adapter:
    steps = plan_forward(shape, dtype, producers, consumers)
    back = None
    if backward:
        back = _plan_normalized(shape, dtype, grad_consumers, grad_producers,
                                grad_consumers, grad_consumers, False)
    return Adapter(shape, dtype, producers, consumers, tuple(steps), back)


def plan_forward(shape: tuple[int, ...], dtype: torch.dtype, producers: _Placements,
                 consumers: _Placements) -> list[Step]:
    """The steps alone (no caching, no backward)."""
    if _same(producers, consumers):
        return []
    summed = _local_sums(shape, producers)
    if summed is not None:  # co-shard: a device's partial sums add up locally first
        return [summed, *plan_forward(shape, dtype, summed.targets, consumers)]
    itemsize = torch.empty((), dtype=dtype).element_size()
    src = Layout.from_placements(shape, producers)
    dst = Layout.from_placements(shape, consumers)
    if src is not None and dst is not None and src.devices == dst.devices:
        regular = plan_regular(src, dst, itemsize)
        if regular is not None:
            steps, reached = regular
            if reached == dst:
                return steps
            fixup = plan_p2p(shape, dtype, reached.placements(), consumers)
            direct = plan_p2p(shape, dtype, producers, consumers)
            if sum(s.nbytes for s in steps) + fixup.nbytes < direct.nbytes:
                return [*steps, fixup]
            return [direct]
    return [plan_p2p(shape, dtype, producers, consumers)]


def _local_sums(shape: tuple[int, ...], producers: _Placements) -> PointToPoint | None:
    """A local step that adds up the value parts a device holds of one region, when that
    makes a regular layout (co-shard's row-parallel linear: parts 2j and 2j+1 of 4 on device
    j become part j of 2, so one all-reduce over the devices follows, not a message per
    part); None when no device holds several placements or the sum is not regular.

    Parts k0..k0+m-1 of V on one device (k0 a multiple of m) are part k0/m of V/m.
    """
    slots: dict[int, list[Region]] = {}
    for d, r in producers:
        slots.setdefault(d, []).append(r)
    if all(len(rs) == 1 for rs in slots.values()):
        return None
    targets: list[Placement] = []
    messages: list[Message] = []
    for d, rs in slots.items():
        ks = sorted(r.part[0] for r in rs)
        m, v = len(rs), rs[0].part[1]
        if (any(r.intervals != rs[0].intervals or r.part[1] != v for r in rs) or v % m
                or ks[0] % m or ks != list(range(ks[0], ks[0] + m))):
            return None
        targets.append((d, rs[0].with_part((ks[0] // m, v // m))))
        messages += [Message(d, i, d, 0, r) for i, r in enumerate(rs)]
    if Layout.from_placements(shape, targets) is None:
        return None
    return PointToPoint(tuple(producers), tuple(targets), tuple(messages), 0)


def _same(producers: _Placements, consumers: _Placements) -> bool:
    """Nothing to move: each device holds the same placements, in the same slot order."""
    return sorted(producers, key=_key) == sorted(consumers, key=_key) and all(
        [r for d2, r in producers if d2 == d] == [r for d2, r in consumers if d2 == d]
        for d, _ in producers)


def _key(p: Placement) -> tuple:
    return (p[0], repr(p[1]))


def plan_identity(shape: Sequence[int], dtype: torch.dtype, placements: Sequence[Placement]) -> Adapter:
    """An adapter that moves nothing (useful to pass a value through the same interface)."""
    pl = tuple(placements)
    back = Adapter(tuple(shape), dtype, full_value(pl), full_value(pl), ())
    return Adapter(tuple(shape), dtype, pl, pl, (), back)


def regions_equal(a: Sequence[Placement], b: Sequence[Placement]) -> bool:
    """Whether two placement lists put the same regions on the same devices (any order)."""
    return sorted(a, key=_key) == sorted(b, key=_key)
