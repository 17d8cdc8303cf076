"""Weight-gradient reducers: a weight region held on several devices has its gradient summed
across them (all-reduce), in buckets, as DDP does.

Replicas of a weight region each compute a contribution to its gradient (each sees other data,
or other partial sums); summing the contributions over the devices that hold the same region
gives the gradient of the single-device model. Regions of one weight held by disjoint device sets
(a tensor-parallel shard under data parallelism) are reduced separately, each over its own set.
Buckets group, per device set, the regions in the order given (the order in which the gradients
are expected to be ready), up to ``bucket_bytes``; one all-reduce per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ssdsl.ir.region import Region
from ssdsl.materialize.steps import Placement

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@attrs.frozen
class Weight:
    """A weight as the reducer sees it: a name, its logical shape and dtype, its placements."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[Placement, ...]


@attrs.frozen
class Bucket:
    """One all-reduce over ``devices`` of the gradients of ``entries`` (flattened, concatenated)."""

    devices: tuple[int, ...]
    entries: tuple[tuple[str, Region], ...]
    size: int  # bytes of the flattened bucket on each device

    @property
    def nbytes(self) -> int:
        """Bytes moved (ring all-reduce, received in total): ``2 (p-1) size``."""
        return 2 * (len(self.devices) - 1) * self.size


@attrs.frozen
class GradReducer:
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def accounting(self) -> dict[str, tuple[int, int]]:
        return {"all_reduce": (len(self.buckets), self.nbytes)} if self.buckets else {}

    def buckets_of(self, device: int) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if device in b.devices)


def plan_grad_reducer(weights: Sequence[Weight], *,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> GradReducer:
    """Buckets of gradient all-reduces for every weight region held by more than one device.

    >>> w = Weight("fc.weight", (4, 4), torch.float32,
    ...            ((0, Region.full((4, 4))), (1, Region.full((4, 4)))))
    >>> plan_grad_reducer([w]).buckets[0].devices
    (0, 1)
    """
    by_set: dict[tuple[int, ...], list[tuple[str, Region, int]]] = {}
    for w in weights:
        holders: dict[Region, set[int]] = {}
        for dev, reg in w.placements:
            holders.setdefault(reg, set()).add(dev)
        for reg, devs in holders.items():
            if len(devs) > 1:
                by_set.setdefault(tuple(sorted(devs)), []).append((w.name, reg, reg.nbytes(w.dtype)))
    buckets: list[Bucket] = []
    for devs in sorted(by_set, key=lambda d: (len(d), d)):
        current: list[tuple[str, Region]] = []
        size = 0
        for name, reg, n in by_set[devs]:
            if current and size + n > bucket_bytes:
                buckets.append(Bucket(devs, tuple(current), size))
                current, size = [], 0
            current.append((name, reg))
            size += n
        if current:
            buckets.append(Bucket(devs, tuple(current), size))
    return GradReducer(tuple(buckets))
