"""Gradient buckets reduced while the backward still runs (the distributed executor only): the
hooks that start each part of a bucket once its gradients are final (``Parts``). Which buckets
and parts is the program's rule, ``ssdsl.lower.overlap`` (module doc there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ssdsl.lower.overlap import OverlapPlan, overlap_plan
from ssdsl.runtime.slots import slots_of

__all__ = ["OverlapPlan", "Parts", "overlap_plan"]


class Parts:
    """The overlapped parts of one rank's program on its weight leaves, in the order they
    start, and the hooks that say when each part's gradients are final.

    The hooks are registered once, on the leaves (which live as long as the program), and act
    only between ``begin`` and ``finish``, around the program's last backward: each one marks
    its weight's gradient final (once, whatever autograd does after) and starts, in order, every
    part whose gradients are all final and whose predecessors have started (``start(k)``)."""

    def __init__(self, plan: OverlapPlan, entries: dict[int, tuple], leaves: dict,
                 start: Callable[[int], None], *, carrier: int | None = None) -> None:
        self.order = [(b, pos) for b, parts in plan.parts.items() for pos in parts]
        # per part, its entries' slots where one is a slice of a leaf (a weight summed piece
        # by piece, ``ssdsl.runtime.slots``), else None; and the leaves the entries lie in
        self.slots = [slots_of(leaves, [entries[b][j] for j in pos]) for b, pos in self.order]
        self.leaves = [[leaves[entries[b][j]] for j in pos] if slots is None
                       else [s.leaf for s in slots]
                       for (b, pos), slots in zip(self.order, self.slots)]
        # the loss rides in the last part of the carrier bucket
        self.carrier = max((k for k, (b, _) in enumerate(self.order) if b == carrier),
                           default=None)
        self._need = [len(pos) for _, pos in self.order]
        self._left = list(self._need)
        self._seen = bytearray(sum(self._need))
        self._next = len(self.order)  # nothing may start until ``begin``
        self._start = start
        self.active = False
        i = 0
        for k, part in enumerate(self.leaves):
            for leaf in part:
                leaf.register_post_accumulate_grad_hook(self._hook(k, i))
                i += 1

    def _hook(self, k: int, i: int) -> Callable[[Any], None]:
        def hook(_leaf: Any) -> None:
            if not self.active or self._seen[i]:
                return
            self._seen[i] = 1
            self._left[k] -= 1
            if k == self._next and not self._left[k]:
                self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and not self._left[self._next]:
            k, self._next = self._next, self._next + 1
            self._start(k)

    def begin(self) -> None:
        """The last backward begins: no gradient of these weights is final yet."""
        self._left = list(self._need)
        self._seen = bytearray(len(self._seen))
        self._next = 0
        self.active = True

    def finish(self) -> None:
        """The last backward is over: every gradient is final (a weight it did not reach has
        none: zeros); the parts not started yet start, in order."""
        self.active = False
        self._left = [0] * len(self._left)
        self._launch_ready()
