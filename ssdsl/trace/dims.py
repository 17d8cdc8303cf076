"""Flowing dim names: follow ``batch``, ``seq``, ``heads``... through every annotated op.

Two steps over the annotations of all ops:

1. *Factoring*: every tensor dim starts as one factor. When an op sees a dim as several factors
   (a view splits ``C`` into ``(h d)``, a split cuts ``3C`` into ``(3 C)``), the cut is copied to
   every other tensor dim the same label touches, until nothing changes. So the fused QKV output
   ``3C`` becomes ``(3 h d)`` and so does the QKV weight's first dim.
2. *Naming*: the elementary factors that an op's label joins are merged (union-find); a class
   takes the name of a model input dim it contains (``INPUT_DIMS``), or a name an op introduces
   (attention's ``heads``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import attrs

from ssdsl.ir.graph import DimFactor, Op, TensorInfo
from ssdsl.ops.core import Annotation, Call, NotAnnotated, annotate_call

DimKey = tuple[str, int]


def flow_names(ops: tuple[Op, ...], tensors: Mapping[str, TensorInfo],
               seeds: Mapping[DimKey, str]) -> dict[str, TensorInfo]:
    """``tensors`` with ``factors`` and ``dim_names`` filled; ``seeds`` names input dims."""
    anns = {op.name: annotate_call(Call(op, tensors)) for op in ops}
    uses = _occurrences(ops, anns)
    cuts = {(t, d): {1, s} for t, info in tensors.items() for d, s in enumerate(info.shape)}
    _factor(ops, uses, cuts)
    names = _name_classes(ops, anns, uses, cuts, seeds)
    return {t: _with_factors(info, cuts, names) for t, info in tensors.items()}


# label occurrences: op name -> label -> [(tensor, dim, inner stride, size)]
Uses = dict[str, dict[str, list[tuple[str, int, int, int]]]]


def _occurrences(ops, anns: Mapping[str, Annotation | NotAnnotated]) -> Uses:
    uses: Uses = {}
    for op in ops:
        ann = anns[op.name]
        if isinstance(ann, NotAnnotated):
            continue
        per: dict[str, list] = {}
        for t, sig in zip((*op.inputs, *op.outputs), (*ann.inputs, *ann.outputs)):
            for d, dim in enumerate(sig):
                lo = 1
                for f in reversed(dim):
                    per.setdefault(f.label, []).append((t, d, lo, f.size))
                    lo *= f.size
        uses[op.name] = per
    return uses


def _factor(ops, uses: Uses, cuts: dict[DimKey, set[int]]) -> None:
    touching: dict[str, list[str]] = {}
    for op in ops:
        for t in (*op.inputs, *op.outputs):
            touching.setdefault(t, []).append(op.name)
    queue, queued = deque(uses), set(uses)
    while queue:
        name = queue.popleft()
        queued.discard(name)
        for occ in uses[name].values():
            for t in _propagate(occ, cuts):
                for other in touching.get(t, ()):
                    if other in uses and other not in queued:
                        queue.append(other)
                        queued.add(other)


def _propagate(occ, cuts: dict[DimKey, set[int]]) -> set[str]:
    rel: set[int] = {1, occ[0][3]}  # the label's own boundaries are cuts too
    for t, d, lo, size in occ:
        rel |= {c // lo for c in cuts[(t, d)] if lo < c < lo * size and c % lo == 0}
    changed: set[str] = set()
    for t, d, lo, size in occ:
        have = cuts[(t, d)]
        for r in rel:
            c = lo * r
            if c not in have and all(c % x == 0 or x % c == 0 for x in have):
                have.add(c)
                changed.add(t)
    return changed


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def _atoms(cuts: set[int], lo: int, size: int) -> list[tuple[int, int]]:
    """The elementary factors ``(inner stride, size)`` inside ``[lo, lo*size)``, outermost first."""
    inside = sorted(c for c in cuts if lo <= c <= lo * size)
    return [(a, b // a) for a, b in zip(inside, inside[1:])][::-1]


def _name_classes(ops, anns, uses: Uses, cuts, seeds: Mapping[DimKey, str]) -> dict:
    uf = _UnionFind()
    for op in ops:
        for occ in uses.get(op.name, {}).values():
            lists = [[(t, d, a) for a, s in _atoms(cuts[(t, d)], lo, size) if s > 1]
                     for t, d, lo, size in occ]
            if len({len(x) for x in lists}) == 1:
                for atoms in zip(*lists):
                    for a in atoms[1:]:
                        uf.union(atoms[0], a)
    named: dict = {}
    for (t, d), name in seeds.items():
        _name_dim(uf, named, cuts, t, d, name)
    for op in ops:
        ann = anns[op.name]
        if isinstance(ann, NotAnnotated):
            continue
        for label, name in ann.names.items():
            for t, d, lo, size in uses[op.name].get(label, [])[:1]:
                atoms = [(t, d, a) for a, s in _atoms(cuts[(t, d)], lo, size) if s > 1]
                _name_atoms(uf, named, atoms, name)
    return {"uf": uf, "named": named}


def _name_dim(uf, named, cuts, t: str, d: int, name: str) -> None:
    size = max(cuts[(t, d)])
    atoms = [(t, d, a) for a, s in _atoms(cuts[(t, d)], 1, size) if s > 1]
    _name_atoms(uf, named, atoms, name)


def _name_atoms(uf, named, atoms, name: str) -> None:
    # A named dim cut into factors names its outermost factor ``name`` (a split of it into N
    # parts, N dividing that factor, is a split of the whole dim) and the others ``name.1``...
    # A class keeps the first name it gets: model inputs are named before op-introduced names.
    for i, atom in enumerate(atoms):
        root = uf.find(atom)
        if root not in named:
            named[root] = name if i == 0 else f"{name}.{i}"


def _with_factors(info: TensorInfo, cuts, names) -> TensorInfo:
    uf, named = names["uf"], names["named"]
    factors = []
    for d, size in enumerate(info.shape):
        atoms = _atoms(cuts[(info.name, d)], 1, size)
        fs = tuple(DimFactor(named.get(uf.find((info.name, d, a))) if s > 1 else None, s)
                   for a, s in atoms) or (DimFactor(None, size),)
        factors.append(fs)
    return attrs.evolve(info, factors=tuple(factors),
                        dim_names=tuple(_dim_name(fs) for fs in factors))


def _dim_name(fs: tuple[DimFactor, ...]) -> str | None:
    if len(fs) == 1:
        return fs[0].name
    if not any(f.name for f in fs):
        return None
    return "(" + " ".join(str(f) for f in fs) + ")"
