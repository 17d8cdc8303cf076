"""Adapters: the frozen description of the communication that moves a tensor between layouts.

An ``Adapter`` is an ordered list of steps. Each step transforms what every device of the adapter
holds; executors (``ssdsl.runtime.comm``) run the same list on torch.distributed for one rank, or
for all ranks at once in one process (the verifier).

Steps on a regular path (one tensor per device, every device in exactly one group of the step):

===============  ==============================================================================
step             what each group does (a group is an ordered tuple of devices)
===============  ==============================================================================
AllGather        concatenate the members' tensors along ``dim`` in group order (D -> R)
AllReduce        sum the members' tensors (V -> R)
ReduceScatter    sum, then member ``m`` keeps chunk ``m`` of ``dim`` (V -> D)
AllToAll         member ``m`` sends chunk ``m'`` of ``split_dim`` to member ``m'``; each
                 concatenates what it receives along ``cat_dim`` in group order (D_i -> D_j)
Chunk            local: member ``m`` keeps chunk ``m`` of ``dim`` (R -> D), no traffic
ZeroSplit        local: member 0 keeps its tensor, the others hold zeros (R -> V), no traffic
===============  ==============================================================================

``PointToPoint`` is the general step: every target placement starts at zero and adds each
``Message`` addressed to it (a spatial sub-region of one source placement). Adding covers both
assembling pieces and summing value parts; a message whose source and destination device are the
same is a local copy and moves no bytes.

Bytes moved (the cost the planner minimises and the accounting reports) is the total received by
all devices under bandwidth-optimal algorithms, for a group of ``p`` devices each holding ``b``
bytes before the step: all-gather ``p(p-1)b``, reduce-scatter ``(p-1)b``, all-reduce ``2(p-1)b``,
all-to-all ``(p-1)b``; chunk and zero-split 0; point-to-point the bytes of each message between
distinct devices. ``count`` is the number of primitive calls (one per group, one per message).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import attrs
import torch

from ssdsl.ir.region import Region

Group = tuple[int, ...]
Placement = tuple[int, Region]


def _relabel_groups(groups: tuple[Group, ...], m: Mapping[int, int]) -> tuple[Group, ...]:
    return tuple(tuple(m[d] for d in g) for g in groups)


@attrs.frozen
class CollectiveStep:
    """A step made of one collective (or local op) per group."""

    kind = "collective"
    groups: tuple[Group, ...]
    nbytes: int

    @property
    def count(self) -> int:
        return len(self.groups) if self.nbytes else 0

    @property
    def devices(self) -> frozenset[int]:
        return frozenset(d for g in self.groups for d in g)

    def relabel(self, m: Mapping[int, int]) -> CollectiveStep:
        return attrs.evolve(self, groups=_relabel_groups(self.groups, m))

    def describe(self) -> str:
        extra = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in attrs.fields(type(self))
                          if f.name not in ("groups", "nbytes"))
        size = len(self.groups[0]) if self.groups else 0
        return (f"{self.kind}({extra}{', ' if extra else ''}{len(self.groups)} groups of {size})"
                f" {self.nbytes} B")


@attrs.frozen
class AllGather(CollectiveStep):
    kind = "all_gather"
    dim: int = 0


@attrs.frozen
class AllReduce(CollectiveStep):
    kind = "all_reduce"


@attrs.frozen
class ReduceScatter(CollectiveStep):
    kind = "reduce_scatter"
    dim: int = 0


@attrs.frozen
class AllToAll(CollectiveStep):
    kind = "all_to_all"
    cat_dim: int = 0
    split_dim: int = 0


@attrs.frozen
class Chunk(CollectiveStep):
    kind = "chunk"
    dim: int = 0


@attrs.frozen
class ZeroSplit(CollectiveStep):
    kind = "zero_split"


@attrs.frozen
class Message:
    """``region`` (spatial part of source slot ``src_slot`` on ``src``) added into ``dst``'s
    target slot ``dst_slot``."""

    src: int
    src_slot: int
    dst: int
    dst_slot: int
    region: Region

    def relabel(self, m: Mapping[int, int]) -> Message:
        return attrs.evolve(self, src=m[self.src], dst=m[self.dst])


@attrs.frozen
class PointToPoint:
    """General step: targets start at zero and add every message sent to them.

    ``sources`` and ``targets`` list placements; a device's slots are its placements in list order.
    """

    kind = "p2p"
    sources: tuple[Placement, ...]
    targets: tuple[Placement, ...]
    messages: tuple[Message, ...]
    nbytes: int

    @property
    def count(self) -> int:
        return sum(1 for msg in self.messages if msg.src != msg.dst)

    @property
    def devices(self) -> frozenset[int]:
        return frozenset(d for d, _ in self.sources) | frozenset(d for d, _ in self.targets)

    def relabel(self, m: Mapping[int, int]) -> PointToPoint:
        return attrs.evolve(
            self, sources=tuple((m[d], r) for d, r in self.sources),
            targets=tuple((m[d], r) for d, r in self.targets),
            messages=tuple(x.relabel(m) for x in self.messages))

    def describe(self) -> str:
        return f"p2p({self.count} messages, {len(self.messages) - self.count} local) {self.nbytes} B"


Step = CollectiveStep | PointToPoint


@attrs.frozen
class Adapter:
    """The communication that turns ``producers``' placements into ``consumers``'.

    ``backward`` is the adapter for the gradients (from the consumers' gradient placements to the
    producers'), or ``None`` when it was not asked for.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    producers: tuple[Placement, ...]
    consumers: tuple[Placement, ...]
    steps: tuple[Step, ...]
    backward: Adapter | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.steps)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of the steps in order, e.g. ``('all_reduce',)``."""
        return tuple(s.kind for s in self.steps)

    @functools.cached_property
    def devices(self) -> frozenset[int]:  # asked by every rank's lowering for every adapter
        return frozenset(d for d, _ in self.producers) | frozenset(d for d, _ in self.consumers)

    def accounting(self) -> dict[str, tuple[int, int]]:
        """``{kind: (count, bytes)}`` of the forward steps."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.steps:
            c, b = out.get(s.kind, (0, 0))
            out[s.kind] = (c + s.count, b + s.nbytes)
        return out

    def relabel(self, m: Mapping[int, int]) -> Adapter:
        """The same adapter with every device ``d`` renamed ``m[d]``."""
        return attrs.evolve(
            self, producers=tuple((m[d], r) for d, r in self.producers),
            consumers=tuple((m[d], r) for d, r in self.consumers),
            steps=tuple(s.relabel(m) for s in self.steps),
            backward=self.backward.relabel(m) if self.backward is not None else None)

    def describe(self) -> str:
        lines = [f"adapter {self.shape} {self.dtype}: {self.nbytes} B"]
        lines += [f"  {s.describe()}" for s in self.steps] or ["  (local)"]
        return "\n".join(lines)
