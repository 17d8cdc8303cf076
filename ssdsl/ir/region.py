"""Regions: which part of a logical tensor a sub-tensor holds.

A ``Region`` of a logical tensor of shape ``S`` gives, for each dim, a tuple of sorted, disjoint,
half-open intervals ``((start, stop), ...)``, plus a value part ``(k, V)``: with ``V > 1`` the
sub-tensor holds the k-th of V partial sums whose total is the logical value.

Several intervals on one dim express a *strided* region: splitting the ``h`` inside a fused
``(3 h d)`` projection dim into 2 gives, for part 0 with h=4, d=2, the intervals
``((0, 4), (8, 12), (16, 20))``.

The local tensor of a region stores the intervals of each dim concatenated in order, so its shape
is the total length of each dim's intervals. ``extract`` and ``add_into`` move values between a
local tensor and a sub-region of it; they are the only place that knows this storage order.

Example::

    >>> r = Region.full((8, 6)).split(dim=0, parts=2, index=1)
    >>> r.intervals, r.local_shape
    (((4, 8),), ((0, 6),)), (4, 6)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

Interval = tuple[int, int]
Intervals = tuple[Interval, ...]


def _normalize(intervals: Iterable[Interval]) -> Intervals:
    """Sorted, merged, non-empty intervals (adjacent ones merged: storage order is the same)."""
    out: list[list[int]] = []
    for start, stop in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and start <= out[-1][1]:
            if start < out[-1][1]:
                raise ValueError(f"overlapping intervals in a region: {intervals}")
            out[-1][1] = stop
        else:
            out.append([start, stop])
    return tuple((a, b) for a, b in out)


def _normalize_dims(dims: Iterable[Iterable[Interval]]) -> tuple[Intervals, ...]:
    """``_normalize`` of each dim; a dim that is one non-empty interval of ints is already in
    that form (the common case: millions of regions at 1,024 ranks)."""
    out = []
    for d in dims:
        if type(d) is tuple and len(d) == 1:
            iv = d[0]
            if type(iv) is tuple and len(iv) == 2 and type(iv[0]) is int \
                    and type(iv[1]) is int and iv[1] > iv[0]:
                out.append(d)
                continue
        out.append(_normalize(d))
    return tuple(out)


def _intersect_intervals(a: Intervals, b: Intervals) -> Intervals:
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _length(intervals: Intervals) -> int:
    return sum(b - a for a, b in intervals)


@attrs.frozen
class Region:
    """A sub-tensor of a logical tensor: per-dim interval sets and a value part ``(k, V)``."""

    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(x) for x in s))
    intervals: tuple[Intervals, ...] = attrs.field(converter=lambda ivs: _normalize_dims(ivs))
    part: tuple[int, int] = attrs.field(default=(0, 1), converter=lambda p: (int(p[0]), int(p[1])))

    def __attrs_post_init__(self) -> None:
        if len(self.shape) != len(self.intervals):
            raise ValueError(f"region rank {len(self.intervals)} != tensor rank {len(self.shape)}")
        for size, ivs in zip(self.shape, self.intervals):
            if ivs and (ivs[0][0] < 0 or ivs[-1][1] > size):
                raise ValueError(f"intervals {ivs} outside a dim of size {size}")
        k, v = self.part
        if not (v >= 1 and 0 <= k < v):
            raise ValueError(f"bad value part {self.part}")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def full(cls, shape: Sequence[int], part: tuple[int, int] = (0, 1)) -> Region:
        """The whole tensor."""
        return cls(tuple(shape), tuple(((0, s),) for s in shape), part)

    @classmethod
    def box(cls, shape: Sequence[int], bounds: Sequence[Interval],
            part: tuple[int, int] = (0, 1)) -> Region:
        """One contiguous interval per dim."""
        return cls(tuple(shape), tuple((b,) for b in bounds), part)

    def split(self, *, dim: int, parts: int, index: int) -> Region:
        """The ``index``-th of ``parts`` equal pieces of this region along ``dim``.

        Pieces are cut in local storage order, so splitting a strided dim keeps the stride (this
        is what a nested partition does to a sub-tensor). Raises ``ValueError`` when ``parts``
        does not divide the local length.
        """
        ivs = self.intervals[dim]
        n = _length(ivs)
        if n % parts:
            raise ValueError(f"{parts} does not divide the length {n} of dim {dim}")
        lo, hi = index * n // parts, (index + 1) * n // parts
        return attrs.evolve(self, intervals=self._replace_dim(dim, _local_range(ivs, lo, hi)))

    def with_part(self, part: tuple[int, int]) -> Region:
        if (int(part[0]), int(part[1])) == self.part:  # a frozen value: itself (no re-normalizing)
            return self
        return attrs.evolve(self, part=part)

    def _replace_dim(self, dim: int, ivs: Intervals) -> tuple[Intervals, ...]:
        return tuple(ivs if d == dim else x for d, x in enumerate(self.intervals))

    # -- queries ------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(_length(ivs) for ivs in self.intervals)

    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.numel() * _itemsize(dtype)

    def is_empty(self) -> bool:
        return self.numel() == 0

    def is_full(self) -> bool:
        return self.spatial() == Region.full(self.shape).intervals

    def spatial(self) -> tuple[Intervals, ...]:
        return self.intervals

    def is_box(self) -> bool:
        """One contiguous interval per dim (the local tensor is a plain slice of the logical one)."""
        return all(len(ivs) == 1 for ivs in self.intervals)

    def box_index(self) -> tuple[slice, ...] | None:
        """Where a box region lies in its logical tensor, as an index of slices (``full[index]``
        is ``slice_of(full)``, a view); ``()`` for the whole tensor, None for a region that is
        not a box."""
        if not self.is_box():
            return None
        if all(ivs == ((0, s),) for ivs, s in zip(self.intervals, self.shape)):
            return ()
        return tuple(slice(a, b) for ((a, b),) in self.intervals)

    def intersect(self, other: Region) -> Region:
        """The spatial intersection; the value part is ``self``'s (parts are matched by callers)."""
        if self.shape != other.shape:
            raise ValueError(f"regions of different tensors: {self.shape} vs {other.shape}")
        ivs = tuple(_intersect_intervals(a, b) for a, b in zip(self.intervals, other.intervals))
        return attrs.evolve(self, intervals=ivs)

    def overlaps(self, other: Region) -> bool:
        """Whether the two regions share an element (spatially; no region is built)."""
        for a, b in zip(self.intervals, other.intervals):
            if len(a) == 1 and len(b) == 1:  # the common case: one interval each
                if a[0][1] <= b[0][0] or b[0][1] <= a[0][0]:
                    return False
            elif not any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b):
                return False
        return True

    def contains(self, other: Region) -> bool:
        """Whether ``other`` lies spatially inside ``self``."""
        return self.intersect(other).intervals == other.intervals

    # -- local index mapping --------------------------------------------------------------------
    def local_positions(self, dim: int, sub: Intervals) -> list[int]:
        """Offsets, in this region's local tensor along ``dim``, of the global indices in ``sub``."""
        out: list[int] = []
        for start, stop in sub:
            out.extend(_to_local(self.intervals[dim], start, stop))
        return out

    def extract(self, local: torch.Tensor, sub: Region) -> torch.Tensor:
        """The values of ``sub`` (spatially inside ``self``) from ``local``, laid out as ``sub``'s
        own local tensor."""
        self._check_local(local)
        if self._contiguous_in(sub):
            out = local
            for d, (first, n) in enumerate(self._narrow_args(sub)):
                out = out.narrow(d, first, n)
            return out
        for d in range(self.ndim):
            idx = torch.tensor(self.local_positions(d, sub.intervals[d]), dtype=torch.long,
                               device=local.device)
            local = local.index_select(d, idx)
        return local

    def add_into(self, local: torch.Tensor, sub: Region, piece: torch.Tensor) -> None:
        """Add ``piece`` (``sub``'s local tensor) into ``local`` in place, at ``sub``'s positions."""
        self._into(local, sub, piece, add=True)

    def copy_into(self, local: torch.Tensor, sub: Region, piece: torch.Tensor) -> None:
        """Write ``piece`` (``sub``'s local tensor) over ``local`` in place, at ``sub``'s
        positions (``extract``'s inverse)."""
        self._into(local, sub, piece, add=False)

    def _into(self, local: torch.Tensor, sub: Region, piece: torch.Tensor, *, add: bool) -> None:
        self._check_local(local)
        if self._contiguous_in(sub):
            view = local
            for d, (first, n) in enumerate(self._narrow_args(sub)):
                view = view.narrow(d, first, n)
            if add:
                view.add_(piece)
            else:
                view.copy_(piece)
            return
        flat = torch.zeros((), dtype=torch.long, device=local.device)
        for d in range(self.ndim):
            pos = torch.tensor(self.local_positions(d, sub.intervals[d]), dtype=torch.long,
                               device=local.device)
            shape = [1] * self.ndim
            shape[d] = -1
            flat = flat * local.shape[d] + pos.view(shape)
        if add:
            local.view(-1).index_add_(0, flat.reshape(-1), piece.reshape(-1).to(local.dtype))
        else:
            local.view(-1).index_copy_(0, flat.reshape(-1), piece.reshape(-1).to(local.dtype))

    def _contiguous_in(self, sub: Region) -> bool:
        return all(len(self.local_positions_runs(d, sub.intervals[d])) <= 1 for d in range(self.ndim))

    def local_positions_runs(self, dim: int, sub: Intervals) -> list[Interval]:
        """``local_positions`` as maximal runs of consecutive offsets."""
        runs: list[list[int]] = []
        for start, stop in sub:
            for a, b in _to_local_runs(self.intervals[dim], start, stop):
                if runs and runs[-1][1] == a:
                    runs[-1][1] = b
                else:
                    runs.append([a, b])
        return [(a, b) for a, b in runs]

    def _narrow_args(self, sub: Region) -> list[tuple[int, int]]:
        out = []
        for d in range(self.ndim):
            runs = self.local_positions_runs(d, sub.intervals[d])
            out.append((runs[0][0], runs[0][1] - runs[0][0]) if runs else (0, 0))
        return out

    def _check_local(self, local: torch.Tensor) -> None:
        if tuple(local.shape) != self.local_shape:
            raise ValueError(f"local tensor of shape {tuple(local.shape)} for a region of local "
                             f"shape {self.local_shape}")

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This region's local tensor taken from the full logical tensor (value part ignored)."""
        return Region.full(self.shape).extract(full, self)

    def __repr__(self) -> str:
        dims = " x ".join(
            "|".join(f"{a}:{b}" for a, b in ivs) or "-" for ivs in self.intervals)
        part = f" part {self.part[0]}/{self.part[1]}" if self.part[1] > 1 else ""
        return f"Region[{dims}{part}]"


def _to_local_runs(ivs: Intervals, start: int, stop: int) -> list[Interval]:
    """Local offset runs of global ``[start, stop)`` inside interval set ``ivs`` (must be covered)."""
    runs: list[Interval] = []
    offset = 0
    covered = 0
    for a, b in ivs:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            runs.append((offset + lo - a, offset + hi - a))
            covered += hi - lo
        offset += b - a
    if covered != stop - start:
        raise ValueError(f"[{start}, {stop}) is not inside {ivs}")
    return runs


def _to_local(ivs: Intervals, start: int, stop: int) -> list[int]:
    return [i for a, b in _to_local_runs(ivs, start, stop) for i in range(a, b)]


def _local_range(ivs: Intervals, lo: int, hi: int) -> Intervals:
    """The global intervals stored at local offsets ``[lo, hi)`` of interval set ``ivs``."""
    out: list[Interval] = []
    offset = 0
    for a, b in ivs:
        s, e = max(lo, offset), min(hi, offset + b - a)
        if s < e:
            out.append((a + s - offset, a + e - offset))
        offset += b - a
    return tuple(out)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def by_identity(cache: dict, region: Region, make) -> str:
    """``make(region)``, kept in ``cache`` by the object's identity (a plan asks the same few
    region objects again and again; the object is held, so its id is not reused while kept;
    the cache is emptied at 65,536 entries)."""
    hit = cache.get(id(region))
    if hit is not None and hit[0] is region:
        return hit[1]
    if len(cache) >= 1 << 16:
        cache.clear()
    text = make(region)
    cache[id(region)] = (region, text)
    return text
