"""Helpers that annotation rules share: plain and broadcast signatures, reshape factorization,
and lowering rules that rewrite size arguments for local shapes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from ssdsl.ops.core import (
    Annotation, Call, Dim, Factor, Interval, LocalCall, LowerFn, Sig, by_extent, local_shape,
    local_size,
)


def plain(labels: Sequence[str], shape: Sequence[int]) -> Sig:
    """One factor per dim: ``plain("bk", (8, 4))`` is ``((b:8,), (k:4,))``."""
    return tuple((Factor(lab, s),) for lab, s in zip(labels, shape, strict=True))


def dims(n: int, prefix: str = "d") -> list[str]:
    """``n`` fresh labels ``d0, d1, ...``."""
    return [f"{prefix}{i}" for i in range(n)]


def broadcast(shapes: Sequence[Sequence[int]], out_shape: Sequence[int],
              prefix: str = "d") -> tuple[tuple[Sig, ...], Sig]:
    """Signatures of inputs broadcast (numpy rules) to ``out_shape``.

    An input dim of size 1 against a larger output dim gets its own label, so a split of the
    output dim reads the whole (size-1) input dim.
    """
    out_labels = dims(len(out_shape), prefix)
    out = plain(out_labels, out_shape)
    sigs = []
    for t, shape in enumerate(shapes):
        offset = len(out_shape) - len(shape)
        sig = []
        for j, s in enumerate(shape):
            lab = out_labels[offset + j]
            if s != out_shape[offset + j]:
                lab = f"{prefix}{offset + j}_b{t}"
            sig.append((Factor(lab, s),))
        sigs.append(tuple(sig))
    return tuple(sigs), out


def reshape_sigs(in_shape: Sequence[int], out_shape: Sequence[int],
                 prefix: str = "r") -> tuple[Sig, Sig, dict[str, str]]:
    """Signatures of a reshape from ``in_shape`` to ``out_shape``, with the labels it freezes.

    Dims are grouped into runs of equal product; within a group, the finest common factorization
    is used when the two sides' factor boundaries nest (``(B, T, C) -> (B, T, h, d)`` makes ``C``
    the merged dim ``(h d)``); a group whose boundaries cross (``(6, 4) -> (4, 6)``) is frozen.
    """
    ins: list[Dim] = [()] * len(in_shape)
    outs: list[Dim] = [()] * len(out_shape)
    frozen: dict[str, str] = {}
    counter = iter(range(10 ** 9))
    fresh = lambda: f"{prefix}{next(counter)}"  # noqa: E731
    for gi, go in _groups(in_shape, out_shape):
        _factor_group(in_shape, out_shape, gi, go, ins, outs, frozen, fresh)
    return tuple(ins), tuple(outs), frozen


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Index groups of ``a`` and ``b`` with equal products; size-1 dims form their own groups."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                gj.append(j)
                pb *= b[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _cuts(sizes: Sequence[int]) -> set[int]:
    out, acc = {1}, 1
    for s in reversed(sizes):
        acc *= s
        out.add(acc)
    return out


def _factor_group(a, b, gi, go, ins, outs, frozen, fresh) -> None:
    if not gi or not go:  # a size-1 dim alone
        for idx, shape, target in ((gi, a, ins), (go, b, outs)):
            for k in idx:
                target[k] = (Factor(fresh(), 1),)
        return
    cuts = sorted(_cuts([a[k] for k in gi]) | _cuts([b[k] for k in go]))
    if all(y % x == 0 for x, y in zip(cuts, cuts[1:])):
        elems = [(fresh(), y // x) for x, y in zip(cuts, cuts[1:])][::-1]  # outermost first
        _assign(a, gi, elems, ins)
        _assign(b, go, elems, outs)
        return
    for idx, shape, target in ((gi, a, ins), (go, b, outs)):
        for k in idx:
            lab = fresh()
            target[k] = (Factor(lab, shape[k]),)
            frozen[lab] = "a reshape mixes this dim with its neighbours"


def _assign(shape, idx, elems, target) -> None:
    pos = 0
    for k in idx:
        dim, prod = [], 1
        while prod < shape[k]:
            lab, s = elems[pos]
            dim.append(Factor(lab, s))
            prod *= s
            pos += 1
        target[k] = tuple(dim)


def lower_sizes(index: int, name: str, *, out: int = 0, transform: Callable | None = None
                ) -> LowerFn:
    """A lowering that sets the size-list argument ``index`` (keyword ``name``) to the local
    shape of output ``out`` (``view``, ``reshape``, ``expand``)."""
    @by_extent
    def lower(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
              kwargs: dict) -> LocalCall:
        sizes = local_shape(ann.outputs[out], ranges)
        if transform is not None:
            sizes = transform(call, sizes)
        return LocalCall(call.op.target, *set_arg(args, kwargs, index, name, tuple(sizes)))
    return lower


def set_arg(args: tuple, kwargs: dict, index: int, name: str, value) -> tuple[tuple, tuple]:
    """``(args, kwargs items)`` with the argument at ``index`` or keyword ``name`` set."""
    if index < len(args):
        return args[:index] + (value,) + args[index + 1:], tuple(kwargs.items())
    return args, tuple({**kwargs, name: value}.items())


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def extent(f: Factor, ranges: Mapping[str, Interval]) -> int:
    start, stop = ranges.get(f.label, (0, f.size))
    return stop - start


def first_value_part(ann: Annotation, ranges: Mapping[str, Interval]) -> bool:
    """Whether a part holds the start of every reduced label, so it alone among the parts of a
    value split adds a term that is not a sum over the reduced dims (a bias).

    Asked of the reduced labels as the annotation has them now: once the tracer cuts ``k`` into
    factors ``k.0, k.1`` (a Conv1D's input features viewed as heads), a split of ``k.1`` starts
    ``k`` at the inner offset, and a test of ``k`` alone would call every part the first."""
    return all(ranges.get(r, (0, 1))[0] == 0 for r in ann.reduced)


__all__ = ["plain", "dims", "broadcast", "reshape_sigs", "lower_sizes", "set_arg", "norm_dim",
           "extent", "first_value_part", "local_size", "local_shape", "math"]
