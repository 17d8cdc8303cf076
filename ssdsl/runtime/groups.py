"""Process groups: one per distinct device set, created once, in the same order on every rank.

``torch.distributed.new_group`` is collective: every rank must call it for every group, in the same
order, even for groups it is not in. So the program first gathers every group its adapters and
reducers use (``groups_of``), sorts them, and creates them all up front (``ProcessGroups.create``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from ssdsl.materialize.reducer import GradReducer
from ssdsl.materialize.steps import Adapter, CollectiveStep
from ssdsl.runtime import shm
from ssdsl.runtime.shm import SameHost


def groups_of(adapters: Iterable[Adapter], reducers: Iterable[GradReducer] = ()) -> list[tuple[int, ...]]:
    """Every device set (sorted, of 2 or more) that the adapters' collectives use, forward and
    backward, and the reducers' buckets, in a deterministic order."""
    found: set[tuple[int, ...]] = {b.devices for r in reducers for b in r.buckets}
    stack = list(adapters)
    while stack:
        ad = stack.pop()
        if ad.backward is not None:
            stack.append(ad.backward)
        for step in ad.steps:
            if isinstance(step, CollectiveStep) and step.nbytes:
                found.update(tuple(sorted(g)) for g in step.groups if len(g) > 1)
    return sorted(found, key=lambda g: (len(g), g))


class ProcessGroups:
    """The process group of each device set; ``None`` stands for the default (world) group."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], object] = {}
        # point-to-point messages with the ranks of this host through shared memory
        # (``ssdsl.runtime.shm``), or None: all through the default group's backend
        self.same_host: SameHost | None = None

    @classmethod
    def create(cls, device_sets: Iterable[Iterable[int]]) -> ProcessGroups:
        """Create every group in ``device_sets``, and the shared-memory channels to this host's
        other ranks (``SameHost.create``); call on every rank with the same argument."""
        pgs = cls()
        world = tuple(range(dist.get_world_size()))
        for members in sorted({tuple(sorted(s)) for s in device_sets}, key=lambda g: (len(g), g)):
            pgs._groups[members] = None if members == world else dist.new_group(list(members))
        pgs.same_host = SameHost.create()
        if pgs.same_host is not None:  # the exchanges' messages too, a tag per group
            shm.register(None, pgs.same_host, 0)
            for number, members in enumerate(pgs._groups, start=1):
                if pgs._groups[members] is not None:
                    shm.register(pgs._groups[members], pgs.same_host, number)
        return pgs

    def get(self, members: Iterable[int]) -> object:
        key = tuple(sorted(members))
        if key not in self._groups and key == tuple(range(dist.get_world_size())):
            return None  # the default group
        if key not in self._groups:
            raise KeyError(f"process group {key} was not created up front (ProcessGroups.create)")
        return self._groups[key]
