"""The AST of a ``.ssp`` file: frozen attrs nodes, each with the ``Span`` it was parsed from.

The AST keeps everything a user wrote except layout and comments (which ``ssdsl.parse.Parsed``
keeps beside it), so the formatter can print it back and elaboration can evaluate it.
Expressions and selectors are separate trees: selectors only appear where a statement expects
operators, and they stay symbolic until a graph exists.
"""

from __future__ import annotations

import attrs

from ssdsl.source import Span

# Limits of the language, stated in docs/language.md ("Limits"). An integer (literal or result)
# fits in 64 bits; an expression or selector nests at most MAX_NESTING levels (a sum of 200 terms
# is 200 levels), which keeps every recursive walk of the AST far from Python's stack limit.
MAX_INT = 2 ** 63 - 1
MAX_NESTING = 200

# ---------------------------------------------------------------- expressions


@attrs.frozen
class Num:
    value: int | float
    text: str  # as written, so the formatter never changes a literal
    span: Span


@attrs.frozen
class Str:
    value: str
    text: str
    span: Span


@attrs.frozen
class Bool:
    value: bool
    span: Span


@attrs.frozen
class Name:
    id: str
    span: Span


@attrs.frozen
class ListLit:
    items: tuple[Expr, ...]
    span: Span


@attrs.frozen
class RangeExpr:
    lo: Expr
    hi: Expr
    inclusive: bool
    span: Span


@attrs.frozen
class BinOp:
    op: str  # + - * / // % == != < <= > >= and or
    left: Expr
    right: Expr
    span: Span


@attrs.frozen
class Unary:
    op: str  # "-" or "not"
    operand: Expr
    span: Span


@attrs.frozen
class Arg:
    name: str | None  # None for a positional argument
    value: Expr
    span: Span


@attrs.frozen
class Call:
    func: str
    args: tuple[Arg, ...]
    span: Span
    func_span: Span


@attrs.frozen
class Index:
    base: Expr
    index: Expr
    span: Span


Expr = Num | Str | Bool | Name | ListLit | RangeExpr | BinOp | Unary | Call | Index

# ---------------------------------------------------------------- selectors


@attrs.frozen
class Segment:
    """One dot-separated piece of a module path.

    ``kind`` is ``name`` (value str), ``index`` (int), ``star``, ``starstar``, ``range`` (value
    (lo, hi, inclusive)) or ``expr`` (value an Expr evaluated at elaboration).
    """

    kind: str
    value: object
    span: Span


@attrs.frozen
class SelPath:
    segments: tuple[Segment, ...]
    span: Span


@attrs.frozen
class SelAll:
    span: Span


@attrs.frozen
class SelRest:
    span: Span


@attrs.frozen
class SelKind:
    kinds: tuple[str, ...]
    span: Span


@attrs.frozen
class SelStage:
    group: str
    index: Expr
    span: Span
    group_span: Span


@attrs.frozen
class SelPart:
    index: tuple[Expr, ...]
    base: Selector
    span: Span


@attrs.frozen
class SelBin:
    op: str  # "|", "&" or "except"
    left: Selector
    right: Selector
    span: Span


Selector = SelPath | SelAll | SelRest | SelKind | SelStage | SelPart | SelBin

# ---------------------------------------------------------------- places and units


@attrs.frozen
class PlaceDevice:
    device: Expr
    span: Span


@attrs.frozen
class PlaceDevices:
    devices: Expr
    span: Span


@attrs.frozen
class MeshCoord:
    axis: str | None  # None for a positional coordinate
    value: Expr | None  # None for "*" (every coordinate along that axis)
    span: Span


@attrs.frozen
class PlaceMesh:
    mesh: str
    coords: tuple[MeshCoord, ...]  # empty for ``mesh NAME`` (the whole mesh)
    span: Span
    mesh_span: Span


Place = PlaceDevice | PlaceDevices | PlaceMesh


@attrs.frozen
class Unit:
    pass_: str | None  # forward, backward, input_grad, weight_grad; None: the operators themselves
    selector: Selector
    mb: Expr | None
    span: Span


@attrs.frozen
class Interleave:
    items: tuple[Unit | Interleave, ...]
    span: Span


SeqItem = Unit | Interleave

# ---------------------------------------------------------------- statements


@attrs.frozen
class Let:
    name: str
    value: Expr
    span: Span


@attrs.frozen
class Partition:
    selector: Selector
    dim: str
    count: Expr
    span: Span


@attrs.frozen
class Replicate:
    selector: Selector
    count: Expr
    span: Span


@attrs.frozen
class Assign:
    selector: Selector
    place: Place
    span: Span


@attrs.frozen
class AssignEach:
    vars: tuple[str, ...]
    parenthesized: bool  # written ``(i, j)``; kept for the formatter
    of: Selector | None
    space: Expr | None
    place: Place
    span: Span


@attrs.frozen
class OrderBefore:
    units: tuple[Unit, ...]
    span: Span


@attrs.frozen
class OrderSeq:
    place: Place
    lines: tuple[tuple[SeqItem, ...], ...]  # one tuple per source line
    block: bool  # written as an indented block
    span: Span
    line_spans: tuple[Span, ...]


@attrs.frozen
class Microbatch:
    dim: str
    count: Expr
    span: Span


@attrs.frozen
class Stages:
    count: Expr | None
    selectors: tuple[Selector, ...]  # empty when ``count`` is given
    name: str
    span: Span
    over: Selector | None = None  # ``stages into N over calls of X``: X's calls
    # ``stages A, B into N, C as st``: per selector, its stage count (None: 1); empty when no
    # selector has one
    splits: tuple[Expr | None, ...] = ()


@attrs.frozen
class Recompute:
    selector: Selector
    span: Span


@attrs.frozen
class Zero:
    selector: Selector | None
    place: Place
    stage: Expr | None
    span: Span


@attrs.frozen
class MeshAxis:
    name: str
    size: Expr
    span: Span


@attrs.frozen
class Mesh:
    name: str
    axes: tuple[MeshAxis, ...]
    origin: Expr | None
    span: Span


@attrs.frozen
class Use:
    target: str
    is_path: bool
    target_text: str
    args: tuple[Arg, ...]
    has_parens: bool
    span: Span
    target_span: Span


@attrs.frozen
class Require:
    cond: Expr
    message: Expr | None
    span: Span


@attrs.frozen
class For:
    var: str
    iter: Expr
    body: tuple[Stmt, ...]
    span: Span
    header_span: Span


@attrs.frozen
class If:
    branches: tuple[tuple[Expr, tuple[Stmt, ...], Span], ...]  # (condition, body, header span)
    orelse: tuple[Stmt, ...] | None
    else_span: Span | None
    span: Span


Stmt = (Let | Partition | Replicate | Assign | AssignEach | OrderBefore | OrderSeq | Microbatch
        | Stages | Recompute | Zero | Mesh | Use | Require | For | If)


@attrs.frozen
class Param:
    name: str
    type: str
    default: Expr | None
    span: Span
    type_span: Span


@attrs.frozen
class Plan:
    name: str
    params: tuple[Param, ...]
    has_parens: bool
    doc: str | None  # the docstring's text without quotes
    doc_text: str | None  # as written, quotes included
    body: tuple[Stmt, ...]
    span: Span  # the header
    doc_span: Span | None
    name_span: Span
