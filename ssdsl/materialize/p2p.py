"""The general path: point-to-point messages of exactly the overlapping regions.

Always correct, whatever the placements (different device groups, uneven assignment, strided
regions, value parts): every target placement receives, for each value part present among the
sources, the sub-regions of it that the sources hold, and adds them up.

Choices, in order, when several sources hold the same values:
1. a device that is both a source and a target keeps its own data (a local copy, no bytes);
2. among replicas, the source that has sent the fewest bytes so far (spreads the load);
3. then the nearest device id (``|src - dst|``), then the lowest id (deterministic).

Value parts: sources are grouped by their part ``(k, V)``; at each point the target adds one
piece of every part that some source holds there, so a part that does not reach a point adds
zero (this is how gradient contributions of consumers of different regions are summed). A
target that asks for a value part ``(k, V)`` gets that part alone when every source is split
into the same V parts; otherwise part 0 gets the whole value and the other parts zeros.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ssdsl.errors import SsdslError
from ssdsl.ir.region import Region
from ssdsl.materialize.steps import Message, Placement, PointToPoint


class UncoveredRegion(SsdslError):
    """A consumer needs values that no producer holds."""


def _preference(dst: int, load: dict[int, int]):
    def key(item: tuple[int, int, Region]) -> tuple:
        src = item[0]
        return (src != dst, load.get(src, 0), abs(src - dst), src)
    return key


def _cells(target: Region, pieces: Sequence[Region]) -> list[Region]:
    """The elementary boxes of ``target`` cut by every boundary of ``pieces``."""
    per_dim: list[list[tuple[int, int]]] = []
    for d, ivs in enumerate(target.intervals):
        cuts = {b for iv in ivs for b in iv}
        cuts |= {b for p in pieces for iv in p.intervals[d] for b in iv}
        pts = sorted(cuts)
        per_dim.append([(a, b) for a, b in zip(pts, pts[1:])
                        if any(s <= a and b <= e for s, e in ivs)])
    return [Region(target.shape, tuple((iv,) for iv in box), target.part)
            for box in itertools.product(*per_dim)]


def _cover(target: Region, holders: list[tuple[int, int, Region]]) -> list[tuple[int, int, Region]]:
    """``(src, slot, piece)`` covering as much of ``target`` as ``holders`` (in preference order)
    hold, with disjoint pieces: whole intersections where possible, elementary cells otherwise."""
    taken: list[tuple[int, int, Region]] = []
    volume = 0
    for src, slot, reg in holders:
        piece = target.intersect(reg)
        if piece.is_empty() or any(not piece.intersect(t).is_empty() for _, _, t in taken):
            continue
        taken.append((src, slot, piece))
        volume += piece.numel()
    if volume == target.numel() or len(taken) == len(holders):
        return taken
    cells = _cells(target, [reg for _, _, reg in holders])
    out = list(taken)
    for cell in cells:
        if any(t.contains(cell) for _, _, t in taken):
            continue
        for src, slot, reg in holders:
            if reg.contains(cell):
                out.append((src, slot, cell))
                break
    return out


def _is_covered(target: Region, pieces: Sequence[Region]) -> bool:
    if sum(p.numel() for p in pieces) >= target.numel() and len({p.part for p in pieces}) == 1:
        return True  # disjoint pieces of one part
    return all(any(p.contains(c) for p in pieces) for c in _cells(target, pieces))


def _slots(placements: Sequence[Placement]) -> list[tuple[int, int, Region]]:
    seen: dict[int, int] = {}
    out = []
    for dev, reg in placements:
        out.append((dev, seen.get(dev, 0), reg))
        seen[dev] = seen.get(dev, 0) + 1
    return out


def _wanted_parts(part: tuple[int, int], sources: list[tuple[int, int, Region]]) -> set | None:
    """The source parts a target of value part ``part`` adds up (``None``: none, it is zero)."""
    parts = {reg.part for _, _, reg in sources}
    k, v = part
    if v == 1:
        return parts
    if all(p[1] == v for p in parts):
        return {part}
    return parts if k == 0 else None


def plan_p2p(shape: tuple[int, ...], dtype: torch.dtype, sources: Sequence[Placement],
             targets: Sequence[Placement]) -> PointToPoint:
    """The point-to-point step from ``sources`` to ``targets`` (see the module docstring)."""
    src_slots = _slots(sources)
    load: dict[int, int] = {}
    messages: list[Message] = []
    nbytes = 0
    for dst, dslot, want in _slots(targets):
        parts = _wanted_parts(want.part, src_slots)
        if parts is None:
            continue
        pieces = []
        for part in sorted(parts):
            holders = sorted((s for s in src_slots if s[2].part == part and
                              not s[2].intersect(want).is_empty()), key=_preference(dst, load))
            for src, sslot, piece in _cover(want.with_part(part), holders):
                messages.append(Message(src, sslot, dst, dslot, piece))
                pieces.append(piece)
                if src != dst:
                    size = piece.nbytes(dtype)
                    load[src] = load.get(src, 0) + size
                    nbytes += size
        if not _is_covered(want, pieces):
            raise UncoveredRegion(
                f"no producer holds all of {want!r} needed on device {dst}",
                hint="every region a consumer reads must be produced on some device")
    return PointToPoint(tuple(sources), tuple(targets), tuple(messages), nbytes)
