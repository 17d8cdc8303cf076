"""Regular layouts: R (replicas) x V (value parts) x D (splits per dim) over a device group.

A ``Layout`` is nnScaler's RVD (DTensor's Replicate / Partial / Shard on a mesh) with the device of
every block written out: the devices form a grid of shape ``(R, V, D_0, ..., D_{n-1})`` stored in
C order. The device at grid coordinate ``(r, v, d_0, ...)`` holds value part ``v`` of ``V`` of
the block ``d_i`` of ``D_i`` equal blocks along each dim ``i``; the ``R`` devices that share
``(v, d)`` hold the same values. Which replica is called ``r = 0`` carries no meaning, so the grid
is kept canonical: along the R axis devices are sorted. Two layouts are equal iff every device
holds the same region.

``Layout.from_placements`` recognises a set of ``(device, Region)`` placements as a layout (or
says it is not one); ``Layout.placements`` is the inverse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from ssdsl.ir.region import Region

Placement = tuple[int, Region]


@attrs.frozen
class Layout:
    """A regular RVD layout of a tensor of ``shape`` over the devices in ``grid``."""

    shape: tuple[int, ...]
    r: int
    v: int
    d: tuple[int, ...]
    grid: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if len(self.d) != len(self.shape):
            raise ValueError(f"{len(self.d)} splits for a tensor of rank {len(self.shape)}")
        if len(self.grid) != self.r * self.v * math.prod(self.d):
            raise ValueError(f"grid of {len(self.grid)} devices for mesh {self.mesh_shape}")
        for size, parts in zip(self.shape, self.d):
            if parts < 1 or size % parts:
                raise ValueError(f"{parts} splits do not divide a dim of size {size}")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def build(cls, shape: Sequence[int], devices: Sequence[int], *, r: int = 1, v: int = 1,
              d: Sequence[int] | None = None) -> Layout:
        """The layout that lays ``devices`` over the mesh ``(r, v, *d)`` in C order.

        >>> Layout.build((4, 6), [0, 1, 2, 3], d=(2, 2)).region_of(3).intervals
        (((2, 4),), ((3, 6),))
        """
        d = tuple(d) if d is not None else (1,) * len(shape)
        return cls.from_array(tuple(shape), np.array(list(devices)).reshape((r, v, *d)))

    @classmethod
    def from_array(cls, shape: tuple[int, ...], grid: np.ndarray) -> Layout:
        """A layout from a device grid of shape ``(R, V, *D)``; the R axis is put in canonical order."""
        canon = np.sort(grid, axis=0)
        r, v, *d = grid.shape
        return cls(tuple(shape), int(r), int(v), tuple(int(x) for x in d),
                   tuple(int(x) for x in canon.reshape(-1)))

    @classmethod
    def from_placements(cls, shape: Sequence[int], placements: Sequence[Placement]) -> Layout | None:
        """The layout these placements form, or ``None`` when they are not regular.

        Regular means: one placement per device; every region one block of an even split along
        each dim; every device the same number V of value parts; every (value part, block)
        held by the same number R of devices.
        """
        shape = tuple(shape)
        devices = [dev for dev, _ in placements]
        if not placements or len(set(devices)) != len(devices):
            return None
        coords = [_block_coords(shape, reg) for _, reg in placements]
        if any(c is None for c in coords):
            return None
        splits = {c[0] for c in coords}
        if len(splits) != 1:
            return None
        v, *d = next(iter(splits))
        blocks: dict[tuple[int, ...], list[int]] = {}
        for dev, (_, idx) in zip(devices, coords):
            blocks.setdefault(idx, []).append(dev)
        r = len(placements) // max(1, len(blocks))
        if len(blocks) != v * math.prod(d) or any(len(b) != r for b in blocks.values()):
            return None
        grid = np.zeros((r, v, *d), dtype=np.int64)
        for idx, devs in blocks.items():
            grid[(slice(None), *idx)] = sorted(devs)
        return cls.from_array(shape, grid)

    # -- queries --------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.r, self.v, *self.d)

    @property
    def signature(self) -> tuple[int, ...]:
        """``(R, V, D_0, ...)``: what the planner searches over."""
        return self.mesh_shape

    def array(self) -> np.ndarray:
        return np.array(self.grid, dtype=np.int64).reshape(self.mesh_shape)

    @property
    def devices(self) -> frozenset[int]:
        return frozenset(self.grid)

    def block_region(self, v: int, d: Sequence[int]) -> Region:
        bounds = [(i * s // n, (i + 1) * s // n) for i, s, n in zip(d, self.shape, self.d)]
        return Region.box(self.shape, bounds, (v, self.v))

    def region_of(self, device: int) -> Region:
        pos = self.grid.index(device)
        _, v, *d = np.unravel_index(pos, self.mesh_shape)
        return self.block_region(int(v), [int(x) for x in d])

    def placements(self) -> tuple[Placement, ...]:
        """``(device, Region)`` of every device, sorted by device."""
        out = []
        for pos, dev in enumerate(self.grid):
            _, v, *d = np.unravel_index(pos, self.mesh_shape)
            out.append((dev, self.block_region(int(v), [int(x) for x in d])))
        return tuple(sorted(out, key=lambda p: p[0]))

    def __repr__(self) -> str:
        return f"Layout(R{self.r} V{self.v} D{self.d} on {sorted(self.devices)})"


def _block_coords(shape: tuple[int, ...], reg: Region) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``((V, D_0, ...), (v, d_0, ...))`` when ``reg`` is one block of an even split, else None."""
    if reg.shape != shape or not reg.is_box() or reg.is_empty():
        return None
    k, v = reg.part
    splits, idx = [v], [k]
    for size, ((start, stop),) in zip(shape, reg.intervals):
        n = stop - start
        if size % n or start % n:
            return None
        splits.append(size // n)
        idx.append(start // n)
    return tuple(splits), tuple(idx)
