"""Where a gradient bucket's entry lies among a rank's weight leaves.

An entry ``(weight, region)`` of a ``reduce`` is usually one of the rank's leaves, whole. Where
the copies of a weight hold overlapping but unequal regions (a partition nested in one part of a
data-parallel split), the reducer sums the weight piece by piece
(``ssdsl.materialize.reducer.holder_pieces``), and a rank that holds a larger region than a
piece reduces that slice of its leaf's gradient: it takes the slice out before the all-reduce
and writes the sum back into it after (``Slot.grad``, ``Slot.put``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from ssdsl.ir.region import Region


@attrs.frozen
class Slot:
    """Entry ``sub`` of a bucket in ``leaf``: the whole leaf (``held`` None) or the slice
    ``sub`` of the leaf that holds region ``held``."""

    leaf: torch.Tensor = attrs.field(eq=False)
    held: Region | None
    sub: Region

    @property
    def whole(self) -> bool:
        return self.held is None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.leaf.shape) if self.held is None else self.sub.local_shape

    def grad(self) -> torch.Tensor:
        """The entry's gradient now (zeros where the backward did not reach the weight; a slice
        gives the leaf a zero gradient to write the sum back into)."""
        g = self.leaf.grad
        if self.held is None:
            return g if g is not None else torch.zeros_like(self.leaf)
        if g is None:
            self.leaf.grad = g = torch.zeros_like(self.leaf)
        return self.held.extract(g, self.sub)

    def put(self, reduced: torch.Tensor) -> None:
        """The reduced gradient becomes the entry's: the leaf's ``.grad`` (a view of the reduced
        buffer, which this rank alone holds), or written over the slice of the leaf's."""
        if self.held is None:
            self.leaf.grad = reduced
        else:
            with torch.no_grad():
                self.held.copy_into(self.leaf.grad, self.sub, reduced)


def slot_of(leaves: Mapping[tuple[str, Region], torch.Tensor], entry: tuple[str, Region]
            ) -> Slot:
    """Where ``entry`` lies among ``leaves``: itself, else the one leaf of its weight whose
    region contains it."""
    leaf = leaves.get(entry)
    if leaf is not None:
        return Slot(leaf, None, entry[1])
    name, sub = entry
    for (other, held), leaf in leaves.items():
        if other == name and held.contains(sub):
            return Slot(leaf, held, sub)
    raise KeyError(entry)


def slots_of(leaves: Mapping[tuple[str, Region], torch.Tensor],
             entries: Sequence[tuple[str, Region]]) -> list[Slot] | None:
    """The slots of ``entries``, or None when every one is a whole leaf (the common case: the
    flat-buffer and view paths apply)."""
    if all(e in leaves for e in entries):
        return None
    return [slot_of(leaves, e) for e in entries]


def pieces(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``flat``, one per shape, one after the other (what follows is left out)."""
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(flat.narrow(0, offset, n).view(shape))
        offset += n
    return out


__all__ = ["Slot", "pieces", "slot_of", "slots_of"]
