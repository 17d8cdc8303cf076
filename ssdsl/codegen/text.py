"""How IR values are written in generated code: identifiers, call arguments, regions.

Everything here is deterministic text (no ids, no addresses, no absolute paths), so a compile of
the same plan on the same model gives the same files byte for byte.
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from collections.abc import Callable
from typing import Any

import torch

from ssdsl.ir.region import Region, by_identity

# Names the generated module itself binds; a tensor must not shadow them.
RESERVED = frozenset({"rt", "batch", "aten", "torch", "forward", "RANK", "WORLD", "SHARDS"})


class Namer:
    """Unique Python identifiers for graph tensors and the values derived from them."""

    def __init__(self) -> None:
        self._used: set[str] = set(RESERVED)

    def fresh(self, wanted: str) -> str:
        """``wanted`` made a valid identifier, with ``_2``, ``_3``... when it is taken."""
        base = re.sub(r"\W", "_", wanted)
        if not base or base[0].isdigit() or keyword.iskeyword(base):
            base = f"t_{base}"
        name, n = base, 1
        while name in self._used:
            n += 1
            name = f"{base}_{n}"
        self._used.add(name)
        return name


def literal(value: Any, slot: Callable[[int], str]) -> str:
    """Python source for one argument of a local call; ``slot(i)`` names tensor input ``i``.

    A ``torch.device`` becomes ``rt.device``: where the rank runs is decided at run time, not by
    the device the model was traced on (often ``meta``).

    >>> literal((2, -1, None, True, 0.5), str)
    '(2, -1, None, True, 0.5)'
    >>> literal([float("-inf"), torch.float32], str)
    "[float('-inf'), torch.float32]"
    """
    from ssdsl.ops.core import Slot

    if isinstance(value, Slot):
        return slot(value.index)
    if isinstance(value, tuple):
        inner = ", ".join(literal(v, slot) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v, slot) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.device):
        return "rt.device"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)  # "torch.float32", "torch.contiguous_format", "torch.strided"
    raise TypeError(f"no code form for argument {value!r} ({type(value).__name__})")


# A plan's regions are few objects asked for again and again (every micro-batch, every rank of
# a class): their text is found by identity first, the object kept alive with it, then by value.
_REGION_TEXT: dict[int, tuple[Region, str]] = {}


def region_text(region: Region) -> str:
    """``"0:4 x 0:32"``: per dim its intervals (``|`` between the runs of a strided dim).

    >>> region_text(Region.box((8, 6), [(4, 8), (0, 6)]))
    '4:8 x 0:6'
    """
    return by_identity(_REGION_TEXT, region, _region_text)


@functools.lru_cache(maxsize=1 << 14)  # a region's fields are ints: equal regions, equal text
def _region_text(region: Region) -> str:
    if not region.shape:
        text = "scalar"
    else:
        text = " x ".join("|".join(f"{a}:{b}" for a, b in ivs) or "-"
                          for ivs in region.intervals)
    k, v = region.part
    return text if v == 1 else f"{text} part {k}/{v}"


def parse_region(text: str, shape: tuple[int, ...]) -> Region:
    """The inverse of ``region_text`` for a tensor of ``shape``.

    >>> parse_region("0:4|8:12 x -", (16, 3)).intervals
    (((0, 4), (8, 12)), ())
    """
    spatial, _, part = text.partition(" part ")
    dims = [] if spatial == "scalar" else spatial.split(" x ")
    intervals = tuple(tuple(_interval(run) for run in d.split("|")) if d != "-" else ()
                      for d in dims)
    k, v = (int(x) for x in part.split("/")) if part else (0, 1)
    return Region(shape, intervals, (k, v))


def _interval(run: str) -> tuple[int, int]:
    a, b = run.split(":")
    return int(a), int(b)
