"""Weight-gradient reducers: a weight region held on several devices has its gradient summed
across them (all-reduce), in buckets, as DDP does.

Replicas of a weight region each compute a contribution to its gradient (each sees other data,
or other partial sums); summing the contributions over the devices that hold the same region
gives the gradient of the single-device model. Regions of one weight held by disjoint device sets
(a tensor-parallel shard under data parallelism) are reduced separately, each over its own set.
Copies of one weight whose regions overlap without being equal (a partition nested inside one
part of a data-parallel split: the weight whole on one device, in halves on two others) are
summed per piece (``holder_pieces``): the weight is cut into the coarsest pieces on which the set
of devices holding it is constant, and each piece held by several devices is reduced over exactly
those devices; a device whose leaf is larger than the piece reduces that slice of its gradient
(``Weight.sliced``, ``ssdsl.runtime.executor``).
Buckets group, per device set, the regions in the order given (the order in which the gradients
are expected to be ready), up to ``bucket_bytes``; one all-reduce per bucket.

Under ``zero X over G`` (``ZeroSpec``), the buckets of X's weights whose device set lies in G are
*sharded* (ZeRO): member ``m`` of the bucket's device set owns chunk ``m`` of the flat bucket
(``shard_range``; the flat length padded up to a multiple of the set's size) and alone steps the
optimizer on it, so the optimizer state exists only for that chunk. Stage 1 still all-reduces
the whole bucket (every member keeps the full reduced gradient); stage 2 reduce-scatters it
(each keeps only its chunk's gradient). After the optimizer step an all-gather of the updated
chunks rebuilds the full weights on every member.

Stage 3 shards the weights themselves: a member keeps only its chunk of the bucket between
uses. Its buckets follow the model's modules (``module_unit``: one per layer, ``h.3``, as FSDP2
wraps each block), split further at ``bucket_bytes``; the lowering gathers a bucket before the
forward of the layer that reads it and again before its backward, frees it after each, and
reduce-scatters its gradient after the last backward that reaches it (``ssdsl.lower.build``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import attrs
import torch

from ssdsl.errors import SsdslError
from ssdsl.ir.region import Region
from ssdsl.materialize.steps import Placement
from ssdsl.source import Span

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@attrs.frozen
class Weight:
    """A weight as the reducer sees it: a name, its logical shape and dtype, its placements."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[Placement, ...]
    unit: str = ""  # the module unit it belongs to (``module_unit``): stage-3 buckets follow it
    # a piece of a weight some holder keeps inside a larger leaf (``holder_pieces``): its
    # gradient is reduced as a slice of that leaf's, which ZeRO cannot shard
    sliced: bool = False


class NotDataParallel(SsdslError):
    """``zero X over G``: no weight of X has its gradient summed over devices of G, so there is
    no optimizer state that G's members hold in copies and could share out."""


@attrs.frozen
class ZeroSpec:
    """A ``zero`` statement resolved to weights: shard the buckets of ``weights`` whose device
    set lies in ``devices`` at ZeRO ``stage``."""

    weights: frozenset[str]
    devices: frozenset[int]
    stage: int
    span: Span | None = None


@attrs.frozen
class Bucket:
    """One all-reduce over ``devices`` of the gradients of ``entries`` (flattened, concatenated);
    ``zero`` > 0: sharded at that ZeRO stage (module docstring)."""

    devices: tuple[int, ...]
    entries: tuple[tuple[str, Region], ...]
    size: int  # bytes of the flattened bucket on each device
    zero: int = 0
    itemsize: int = 4
    span: Span | None = attrs.field(default=None, eq=False)
    gathers: int = 2  # stage 3: all-gathers of the bucket per step (forward and backward, per
    # micro-batch, less one per forward that keeps it for its backward: ``keep``)
    keep: bool = False  # stage 3: gathered from the end of a forward into its own backward

    @property
    def padded(self) -> int:
        """Bytes of the flat bucket padded to a multiple of the member count (sharded buckets)."""
        p, items = len(self.devices), self.size // self.itemsize
        return -(-items // p) * p * self.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes moved, received in total by the members (ring algorithms): all-reduce
        ``2 (p-1) size``; reduce-scatter and all-gather ``(p-1) padded`` each."""
        return sum(n for _, _, n in self.collectives())

    def collectives(self) -> tuple[tuple[str, int, int], ...]:
        """``(kind, count, bytes)`` of each collective this bucket runs per step."""
        p = len(self.devices)
        if self.zero == 0:
            return (("all_reduce", 1, 2 * (p - 1) * self.size),)
        first = (("all_reduce", 1, 2 * (p - 1) * self.size) if self.zero == 1
                 else ("reduce_scatter", 1, (p - 1) * self.padded))
        n = self.gathers if self.zero == 3 else 1
        return first, ("all_gather", n, n * (p - 1) * self.padded)


def module_unit(qualified: str) -> str:
    """The module unit of a parameter (its qualified name): the path up to the first layer
    index, else its top-level module; stage-3 buckets do not mix units.

    >>> module_unit("h.3.attn.c_attn.weight"), module_unit("wte.weight"), module_unit("bias")
    ('h.3', 'wte', '')
    """
    parts = qualified.split(".")[:-1]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0] if parts else ""


def shard_range(numel: int, members: int, index: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a flat bucket of ``numel`` that member ``index`` of ``members``
    owns: chunks of ``ceil(numel / members)``, the last ones short or empty (padding).

    >>> [shard_range(5, 4, m) for m in range(4)]
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    chunk = -(-numel // members)
    return min(index * chunk, numel), min((index + 1) * chunk, numel)


def holder_pieces(placements: Sequence[tuple[Any, Region]]) -> list[tuple[Region, tuple]]:
    """The coarsest pieces of a weight on which the set of holders is constant, each with its
    holders (sorted), for ``placements`` ``(holder, region)`` that may overlap unequally (a
    holder: a device, or anything sortable that names a leaf).

    Each dim is cut at every holder's interval bounds; the cells (the products of the cut
    intervals that some holder covers) with the same holders are merged, two pieces at a time
    where they differ in one dim only, until none merge. Pieces come in the order of their
    first cell (row-major).

    >>> full, top, bottom = (Region.full((4, 2)), Region.box((4, 2), [(0, 2), (0, 2)]),
    ...                      Region.box((4, 2), [(2, 4), (0, 2)]))
    >>> holder_pieces([(1, full), (0, top), (2, bottom)])
    [(Region[0:2 x 0:2], (0, 1)), (Region[2:4 x 0:2], (1, 2))]
    """
    if not placements:
        return []
    shape = placements[0][1].shape
    cuts: list[list[tuple[int, int]]] = []
    for d in range(len(shape)):
        bounds = sorted({b for _, r in placements for iv in r.intervals[d] for b in iv})
        cuts.append(list(pairwise(bounds)))
    cells: list[tuple[tuple[tuple[tuple[int, int], ...], ...], tuple]] = []

    def walk(d: int, box: tuple[tuple[int, int], ...]) -> None:
        if d == len(shape):
            cell = Region(shape, tuple((iv,) for iv in box))
            devs = tuple(sorted({dev for dev, r in placements if r.contains(cell)}))
            if devs:
                cells.append((tuple((iv,) for iv in box), devs))
            return
        for iv in cuts[d]:
            walk(d + 1, (*box, iv))

    walk(0, ())
    pieces = [[list(ivs), devs] for ivs, devs in cells]
    merged = True
    while merged:
        merged = False
        for i in range(len(pieces)):
            for j in range(i + 1, len(pieces)):
                a, b = pieces[i], pieces[j]
                if a[1] != b[1]:
                    continue
                differ = [d for d in range(len(shape)) if a[0][d] != b[0][d]]
                if len(differ) <= 1:
                    for d in differ:
                        a[0][d] = tuple(sorted((*a[0][d], *b[0][d])))
                    del pieces[j]
                    merged = True
                    break
            if merged:
                break
    return [(Region(shape, tuple(ivs)), devs) for ivs, devs in pieces]


@attrs.frozen
class GradReducer:
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def accounting(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for b in self.buckets:
            for kind, count, nbytes in b.collectives():
                c, n = out.get(kind, (0, 0))
                out[kind] = (c + count, n + nbytes)
        return out

    def buckets_of(self, device: int) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if device in b.devices)


def plan_grad_reducer(weights: Sequence[Weight], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      zero: Sequence[ZeroSpec] = (), gathers: int = 2) -> GradReducer:
    """Buckets of gradient all-reduces for every weight region held by more than one device.

    >>> w = Weight("fc.weight", (4, 4), torch.float32,
    ...            ((0, Region.full((4, 4))), (1, Region.full((4, 4)))))
    >>> plan_grad_reducer([w]).buckets[0].devices
    (0, 1)
    """
    by_set: dict[tuple[tuple[int, ...], ZeroSpec | None],
                 list[tuple[str, Region, int, str]]] = {}
    used: set[ZeroSpec] = set()
    itemsize = {w.name: w.dtype.itemsize for w in weights}
    for w in weights:
        holders: dict[Region, set[int]] = {}
        for dev, reg in w.placements:
            holders.setdefault(reg, set()).add(dev)
        for reg, devs in holders.items():
            if len(devs) > 1:
                spec = next((z for z in zero if w.name in z.weights and devs <= z.devices), None)
                if spec is not None:
                    used.add(spec)
                by_set.setdefault((tuple(sorted(devs)), spec), []).append(
                    (w.name, reg, reg.nbytes(w.dtype), w.unit))
    for z in zero:
        if z not in used:
            raise NotDataParallel(
                f"zero over devices {sorted(z.devices)}: none of the selected weights has its "
                "gradient summed over these devices (they are not a data-parallel group of them)",
                z.span, hint="zero over the devices that hold copies of the weights, e.g. the "
                "dp axis of a mesh (`zero over m[tp=0]`) or all devices under dp")
    buckets: list[Bucket] = []
    for devs, spec in sorted(by_set, key=lambda k: (len(k[0]), k[0], k[1] is not None)):
        stage = spec.stage if spec is not None else 0
        span = spec.span if spec is not None else None
        current: list[tuple[str, Region]] = []
        size, unit = 0, None
        for name, reg, n, w_unit in by_set[(devs, spec)]:
            if current and (size + n > bucket_bytes or (stage == 3 and w_unit != unit)):
                buckets.append(Bucket(devs, tuple(current), size, stage, itemsize[name], span,
                                      gathers))
                current, size = [], 0
            current.append((name, reg))
            size += n
            unit = w_unit
        if current:
            buckets.append(Bucket(devs, tuple(current), size, stage, itemsize[current[0][0]],
                                  span, gathers))
    return GradReducer(tuple(buckets))
