"""``order`` between operators in a plan without stages: the operator order every device runs.

Without stages, every device walks the operators in one order, the same on all devices (so the
collectives of their parts line up). ``order A before B`` between operator selections (and an
``order on devices G: A, B, C`` sequence of operator selections, read as ``A before B before C``)
becomes that order: every operator of A runs before every operator of B. The order is the
traced order wherever no statement asks otherwise (a stable topological order of the data edges
and the statements' edges), and it is kept as data: the operators of ``Transformed.graph`` in
that order, which every later phase walks.

A statement that contradicts a data dependency (an operator of B produces, directly or not, an
input of an operator of A; or A and B share an operator) is refused at its line, and so are
statements that together form a cycle with the data. Passes of stages (``forward st[0] mb 0``)
in a plan without ``stages`` are refused too: nothing would run them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import attrs

from ssdsl.elaborate.directives import OrderBefore, OrderSequence, WorkUnit
from ssdsl.errors import ErrorCollector
from ssdsl.ir.graph import Graph
from ssdsl.schedule.lower import OrderConflict, UnsupportedOrderUnit
from ssdsl.source import Span
from ssdsl.transform.parts import Transformed
from ssdsl.transform.select import select_ops

_OpBefore = tuple[list[int], list[int], Span, str]


def order_operators(t: Transformed) -> Transformed:
    """``t`` with its graph's operators in the order the plan's ``order`` statements ask for
    (unchanged when it has none); ``OrderConflict`` at a statement that contradicts the data."""
    befores = _op_befores(t.graph, t.deferred)
    if not befores:
        return t
    ops = t.graph.ops
    preds = _data_preds(t.graph)
    _refuse_against_data(preds, befores,
                         [f"'{op.name}' (in '{op.module or '<top>'}')" for op in ops])
    order = _stable_topological(len(ops), preds, befores)
    return attrs.evolve(t, graph=attrs.evolve(t.graph, ops=tuple(ops[i] for i in order)))


def _op_befores(graph: Graph, directives: Sequence[object]) -> list[_OpBefore]:
    index = {op.name: i for i, op in enumerate(graph.ops)}
    out: list[_OpBefore] = []
    errors = ErrorCollector()
    for d in directives:
        with errors.catch():
            if isinstance(d, OrderBefore):
                pairs = [(d.before, d.after)]
            elif isinstance(d, OrderSequence):
                pairs = list(zip(d.units, d.units[1:]))
            else:
                continue
            for a, b in pairs:
                out.append(([index[n] for n in _ops_of(graph, a, d.span)],
                            [index[n] for n in _ops_of(graph, b, d.span)], d.span,
                            f"{a} before {b}"))
    errors.raise_if_any()
    return out


def _ops_of(graph: Graph, unit: WorkUnit, span: Span) -> list[str]:
    if unit.pass_ != "op":
        raise UnsupportedOrderUnit(
            f"'{unit}' names a pass of a stage, but the plan has no 'stages' statement",
            span, hint="add 'stages ... as st' and assign the stages, or order operators "
            "('order h.0.attn before h.1.mlp')")
    return select_ops(graph, unit.selector, span)


def _data_preds(graph: Graph) -> list[list[int]]:
    producer: dict[str, int] = {}
    preds: list[list[int]] = []
    for i, op in enumerate(graph.ops):
        preds.append(sorted({producer[x] for x in op.inputs if x in producer}))
        producer.update((x, i) for x in op.outputs)
    return preds


def _refuse_against_data(preds: list[list[int]], befores: list[_OpBefore],
                         names: list[str]) -> None:
    # ancestors as bit sets, in the traced (topological) order
    anc = [0] * len(preds)
    for i, ps in enumerate(preds):
        for p in ps:
            anc[i] |= anc[p] | (1 << p)
    errors = ErrorCollector()
    for a_ops, b_ops, span, text in befores:
        b_bits = sum(1 << b for b in set(b_ops))
        shared = sorted(set(a_ops) & set(b_ops))
        if shared:
            errors.add(OrderConflict(f"'{text}': operator {names[shared[0]]} is on both sides",
                                     span, hint="order disjoint sets of operators"))
            continue
        bad = next(((a, b) for a in a_ops if anc[a] & b_bits
                    for b in b_ops if anc[a] >> b & 1), None)
        if bad is not None:
            a, b = bad
            errors.add(OrderConflict(
                f"'{text}' contradicts the data: operator {names[a]} reads what operator "
                f"{names[b]} computes (directly or through others)", span,
                hint="order operators that do not depend on each other, or swap the two sides"))
    errors.raise_if_any()


def _stable_topological(n: int, preds: list[list[int]], befores: list[_OpBefore]) -> list[int]:
    """The traced order, changed only where a statement asks (each pulled forward as little as
    possible); ``OrderConflict`` when the statements and the data form a cycle."""
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i, ps in enumerate(preds):
        for p in ps:
            succ[p].append(i)
            indeg[i] += 1
    # one extra node per statement: all of A -> node -> all of B (not |A| x |B| edges)
    spans: list[Span] = []
    for a_ops, b_ops, span, _ in befores:
        node = len(succ)
        succ.append(list(b_ops))
        indeg.append(len(set(a_ops)))
        spans.append(span)
        for a in set(a_ops):
            succ[a].append(node)
        for b in b_ops:
            indeg[b] += 1
    # the statement nodes go first among ready nodes: they release what they hold back at once
    heap = [_key(i, n) for i in range(len(succ)) if indeg[i] == 0]
    heapq.heapify(heap)
    out: list[int] = []
    while heap:
        _, i = heapq.heappop(heap)
        if i < n:
            out.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(heap, _key(j, n))
    if len(out) < n:
        stuck = sorted(spans[i - n] for i in range(n, len(succ)) if indeg[i] > 0)
        raise OrderConflict("order statements and data dependencies form a cycle", stuck[0],
                            hint="remove or reverse one of the order statements"
                            + (f" (also line {', '.join(str(s.line) for s in stuck[1:])})"
                               if len(stuck) > 1 else ""))
    return out


def _key(i: int, n: int) -> tuple[int, int]:
    return (-1, i) if i >= n else (i, i)
