"""Annotations of a traced graph's ops, aligned with the graph's flowing dim names.

The tracer factors each tensor dim as finely as the ops using it need (``TensorInfo.factors``);
``annotate`` cuts the op's labels into the same factors and names them, so a plan's ``heads``
finds its label in every op it flows through, the fused QKV linear included.
"""

from __future__ import annotations

import attrs

from ssdsl.ir.graph import Graph, Op, TensorInfo
from ssdsl.ops.core import Annotation, Call, NotAnnotated, annotate_call


def call_of(graph: Graph, op: Op) -> Call:
    """The ``Call`` view of ``op`` in ``graph`` (what rules and lowerings see)."""
    return Call(op, graph.tensors)


def annotate(graph: Graph, op: Op) -> Annotation | NotAnnotated:
    """``op``'s annotation, refined to the graph's dim factors, with flowing names attached."""
    ann = annotate_call(call_of(graph, op))
    if isinstance(ann, NotAnnotated):
        return ann
    return align(ann, [graph.tensors[t] for t in (*op.inputs, *op.outputs)])


def label_for_name(graph: Graph, op: Op, name: str) -> tuple[Annotation, str] | None:
    """``(annotation, label)`` of ``op`` for flowing name ``name``, or None when it has none."""
    ann = annotate(graph, op)
    if isinstance(ann, NotAnnotated):
        return None
    label = ann.label_for(name)
    return (ann, label) if label else None


def _occurrences(ann: Annotation, infos: list[TensorInfo]):
    """For each tensor dim: (info, dim index, annotation factors)."""
    for info, sig in zip(infos, (*ann.inputs, *ann.outputs)):
        for d, dim in enumerate(sig):
            yield info, d, dim


def align(ann: Annotation, infos: list[TensorInfo]) -> Annotation:
    """``ann`` with labels cut at the factor boundaries of ``infos`` and named after them."""
    cuts: dict[str, set[int]] = {}
    for info, d, dim in _occurrences(ann, infos):
        graph_cuts = _cuts(info.factors[d])
        lo = 1
        for f in reversed(dim):
            rel = {c // lo for c in graph_cuts if lo < c < lo * f.size and c % lo == 0}
            cuts.setdefault(f.label, set()).update(rel)
            lo *= f.size
    sizes = ann.sizes()
    for label, rel in cuts.items():
        chain = sorted(rel | {1, sizes[label]})
        if len(chain) > 2 and all(b % a == 0 for a, b in zip(chain, chain[1:])):
            ann = ann.refined(label, [b // a for a, b in zip(chain, chain[1:])][::-1])
    return _named(ann, infos)


def _cuts(factors) -> set[int]:
    out, acc = {1}, 1
    for f in reversed(factors):
        acc *= f.size
        out.add(acc)
    return out


def _named(ann: Annotation, infos: list[TensorInfo]) -> Annotation:
    names: dict[str, str] = {}
    for info, d, dim in _occurrences(ann, infos):
        spans = {}
        lo = 1
        for g in reversed(info.factors[d]):
            spans[(lo, g.size)] = g.name
            lo *= g.size
        lo = 1
        for f in reversed(dim):
            name = spans.get((lo, f.size))
            if name and f.label not in names:
                names[f.label] = name
            lo *= f.size
    return attrs.evolve(ann, names={**ann.names, **names})
