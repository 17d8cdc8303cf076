"""Multiply-adds of the operators whose work is arithmetic: matmuls, convolutions, attention.

One count, read from an operator's annotation label sizes (narrowed to a part's ranges where
a part is costed), shared by the cost model's rules (``ssdsl.cost.ops``: FLOPs are twice these)
and by the automatic stage cut (``ssdsl.schedule.resolve.op_cost``). Every other operator moves
memory, which this count does not measure.

>>> multiply_adds("linear", {"n": 8, "o": 4, "i": 3})
96.0
>>> multiply_adds("scaled_dot_product_attention", {"B": 2, "H": 4, "L": 10, "S": 10, "E": 8,
...                                                 "Ev": 8})
(6400.0, 6400.0)
>>> multiply_adds("add", {"n": 8}) is None
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum"})
CONVOLUTIONS = frozenset({"conv1d", "conv2d", "conv3d", "convolution"})
TRANSPOSED = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
ATTENTION = "scaled_dot_product_attention"


def aten_name(target: str) -> str:
    """``aten.linear.default`` -> ``linear``."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else target


def multiply_adds(kind: str, sizes: Mapping[str, int]) -> float | tuple[float, float] | None:
    """The multiply-adds of an operator of ATen name ``kind`` (``"linear"``) over label
    ``sizes``: a float for a matmul or a convolution, ``(Q K^T, P V)`` for an attention, None
    for any other operator.

    A matmul's is the product of its labels (``M N K`` with batch dims). A convolution's leaves
    out its input positions (``h0``, ``h1``...: each output position reads a window of them),
    keeping the output positions and the kernel offsets; a transposed convolution's leaves out
    its output positions (``o0``...: each input position writes a window of them). An attention's labels are grouped by
    root (a label split in pieces, ``E.0``, ``E.1``, counts as their product): queries ``L``,
    keys ``S``, head dim ``E``, value dim ``Ev``, the rest batch dims (mask dims, ``m...``,
    excepted)."""
    if kind in MATMULS:
        return float(math.prod(sizes.values()))
    if kind in CONVOLUTIONS:
        return float(math.prod(v for k, v in sizes.items()
                               if not (k[:1] == "h" and k[1:].isdigit())))
    if kind in TRANSPOSED:  # each input position scatters a kernel's window of outputs
        return float(math.prod(v for k, v in sizes.items()
                               if not (k[:1] == "o" and k[1:].isdigit())))
    if kind != ATTENTION:
        return None
    dims: dict[str, int] = {}
    for label, size in sizes.items():
        root = label.split(".")[0]
        dims[root] = dims.get(root, 1) * size
    L, S, E, Ev = (dims.pop(k, 1) for k in ("L", "S", "E", "Ev"))
    scores = math.prod(v for k, v in dims.items() if not k.startswith("m")) * L * S
    return float(scores * E), float(scores * Ev)
