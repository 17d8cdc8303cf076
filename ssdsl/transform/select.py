"""Resolving symbolic selectors against a traced graph.

A path selector matches an operator when the operator's module path starts with the selector's
segments: ``h.*.attn`` matches every op called inside ``h.0.attn`` (and its children). ``*`` is one
level, ``**`` any number of levels (zero included), an ``IndexRange`` one integer level in range.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from ssdsl.elaborate.directives import (
    All, Except, Intersect, Kind, PartOf, Path, Rest, Selector, StageRef, Union,
)
from ssdsl.ir.graph import Graph
from ssdsl.source import Span
from ssdsl.transform.errors import EmptySelection, UnsupportedSelector


def select_ops(graph: Graph, sel: Selector, span: Span | None) -> list[str]:
    """Names of the ops ``sel`` matches, in graph order; an empty match is an error."""
    names = _ops(graph, sel, span)
    if not names:
        raise EmptySelection(f"'{sel}' matches no operator{_suggest(graph, sel)}", span,
                             hint="`ssdsl trace MODEL` lists the operators and their module paths")
    return [op.name for op in graph.ops if op.name in names]


def part_prefix(sel: Selector) -> tuple[tuple[int, ...], Selector]:
    """``(index prefix, base selector)``: ``part i of X`` narrows X's parts to index prefix (i,)."""
    if isinstance(sel, PartOf):
        inner, base = part_prefix(sel.base)
        return sel.index + inner, base
    return (), sel


def _ops(graph: Graph, sel: Selector, span: Span | None) -> set[str]:
    if isinstance(sel, All):
        return {op.name for op in graph.ops}
    if isinstance(sel, Path):
        return {op.name for op in graph.ops if _match(sel.segments, _segments(op.module))}
    if isinstance(sel, Kind):
        return {op.name for op in graph.ops if op.kind in sel.kinds}
    if isinstance(sel, Rest):
        taken: set[str] = set()
        for ex in sel.excluded:
            taken |= _ops(graph, ex, span)
        return {op.name for op in graph.ops} - taken
    if isinstance(sel, Union):
        _whole_parts_only(sel, span)
        return _ops(graph, sel.left, span) | _ops(graph, sel.right, span)
    if isinstance(sel, Intersect):
        _whole_parts_only(sel, span)
        return _ops(graph, sel.left, span) & _ops(graph, sel.right, span)
    if isinstance(sel, Except):
        _whole_parts_only(sel, span)
        return _ops(graph, sel.left, span) - _ops(graph, sel.right, span)
    if isinstance(sel, PartOf):
        return _ops(graph, sel.base, span)
    if isinstance(sel, StageRef):
        raise UnsupportedSelector(f"stage '{sel}' cannot select operators in this statement "
                                  f"(a stage is taken by assign, order and recompute only)",
                                  span, hint="select the stage's operators by module path")
    raise TypeError(f"unknown selector {sel!r}")


def _whole_parts_only(sel: Union | Intersect | Except, span: Span | None) -> None:
    """``part i of X`` narrows the parts a whole statement selects (``part_prefix``); inside a
    union, an intersection or an except it would select every part of X's operators."""
    for side in (sel.left, sel.right):
        if isinstance(side, PartOf):
            raise UnsupportedSelector(
                f"'{side}' inside '|', '&' or 'except' would select every part of its "
                f"operators: `part i of` narrows the whole selector of a statement only", span,
                hint=f"put the part around the rest: `part {', '.join(map(str, side.index))} "
                     f"of (A | B)`, or write one statement per selection")


def path_matches(sel: Path, module: str) -> bool:
    """Whether the path selector ``sel`` selects the operators called inside ``module``."""
    return _match(sel.segments, _segments(module))


def _segments(module: str) -> tuple[str, ...]:
    return tuple(module.split(".")) if module else ()


def _match(pattern: Sequence, path: Sequence[str]) -> bool:
    """Whether ``pattern`` matches a prefix of ``path``."""
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, path[i:]) for i in range(len(path) + 1))
    if not path:
        return False
    return _match_one(head, path[0]) and _match(rest, path[1:])


def _match_one(seg, name: str) -> bool:
    if seg == "*":
        return True
    if isinstance(seg, int):
        return name == str(seg)
    if hasattr(seg, "lo"):
        return name.isdigit() and seg.lo <= int(name) < seg.hi
    return seg == name


def _suggest(graph: Graph, sel: Selector) -> str:
    if isinstance(sel, (Union, Intersect, Except)):
        # a compound selector: a suggestion for each of its paths and kinds that matches nothing
        # on its own (a misspelt path on both sides of an ``except``), each named
        empty = [s for s in _atoms(sel) if not _ops(graph, s, None)]
        hints = [f"'{s}'{_suggest(graph, s) or ' matches no operator'}" for s in empty]
        return f": {'; '.join(hints)}" if hints else ""
    if not isinstance(sel, (Path, Kind)):
        return ""
    kinds = {op.kind for op in graph.ops}
    if isinstance(sel, Kind):
        pool = sorted(kinds)
        words = list(sel.kinds)
    elif len(sel.segments) == 1 and sel.segments[0] in kinds:  # a kind written as a path
        return f" (did you mean 'kind({sel.segments[0]})', the operators of that kind?)"
    elif (fixed := _repair_path(graph, sel)) is not None:
        return f" (did you mean '{fixed}'?)"
    else:
        pool = sorted({prefix for op in graph.ops for prefix in _prefixes(op.module)})
        words = [str(sel)]
    close = [m for w in words for m in difflib.get_close_matches(w, pool, n=3, cutoff=0.5)]
    return f" (did you mean {', '.join(repr(c) for c in dict.fromkeys(close))}?)" if close else ""


def _atoms(sel: Selector) -> list[Selector]:
    """The paths and kinds a compound selector is made of, left to right, once each."""
    if isinstance(sel, (Union, Intersect, Except)):
        return list(dict.fromkeys([*_atoms(sel.left), *_atoms(sel.right)]))
    return [sel] if isinstance(sel, (Path, Kind)) else []


def _repair_path(graph: Graph, sel: Path) -> Path | None:
    """``sel`` with its misspelt name segments replaced by the closest module names, wildcards
    kept (``h.*.atn`` -> ``h.*.attn``), when that matches some operator; else None."""
    names = sorted({s for op in graph.ops for s in _segments(op.module) if not s.isdigit()})
    segments = list(sel.segments)
    for i, seg in enumerate(segments):
        if isinstance(seg, str) and seg not in ("*", "**") and seg not in names:
            close = difflib.get_close_matches(seg, names, n=1, cutoff=0.6)
            if not close:
                return None
            segments[i] = close[0]
    if segments == list(sel.segments):
        return None
    fixed = Path(tuple(segments))
    return fixed if any(_match(fixed.segments, _segments(op.module)) for op in graph.ops) else None


def _prefixes(module: str) -> list[str]:
    segs = _segments(module)
    return [".".join(segs[:i]) for i in range(1, len(segs) + 1)]
