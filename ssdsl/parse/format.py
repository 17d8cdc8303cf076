"""The canonical form of a plan (``ssdsl fmt``).

The AST is printed back with one statement per line, 4-space blocks, single spaces around
operators and only the parentheses precedence needs. Nothing a user wrote is lost: literals keep
their spelling, the docstring is kept verbatim, every comment is kept (a comment at the end of a
code line stays there; a comment on its own line goes above the code line that follows it), and
a run of blank lines between two lines becomes one blank line.

``format_text`` checks its own output: it parses it again and compares the AST (positions aside)
and the comments with the input's, so a formatter bug raises instead of changing a plan.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import attrs

from ssdsl.errors import SsdslError
from ssdsl.parse import Parsed, parse_text
from ssdsl.parse import ast as A
from ssdsl.source import Span

INDENT = "    "


@attrs.define
class _Line:
    """An output line of code, with the source lines it came from."""

    text: str
    depth: int
    start: int
    end: int
    leading: list[str] = attrs.field(factory=list)
    trailing: str | None = None


# ================================================================ expressions

_PREC = {"or": 2, "and": 3, "==": 5, "!=": 5, "<": 5, "<=": 5, ">": 5, ">=": 5,
         "+": 6, "-": 6, "*": 7, "/": 7, "//": 7, "%": 7}


def expr(e: A.Expr, prec: int = 0) -> str:
    """An expression; parenthesized when its precedence is below ``prec``."""
    text, own = _expr(e)
    return f"({text})" if own < prec else text


def _expr(e: A.Expr) -> tuple[str, int]:
    if isinstance(e, (A.Num, A.Str)):
        return e.text, 10
    if isinstance(e, A.Bool):
        return ("true" if e.value else "false"), 10
    if isinstance(e, A.Name):
        return e.id, 10
    if isinstance(e, A.ListLit):
        return "[" + ", ".join(expr(x) for x in e.items) + "]", 10
    if isinstance(e, A.RangeExpr):
        return f"{expr(e.lo, 2)}{'..=' if e.inclusive else '..'}{expr(e.hi, 2)}", 1
    if isinstance(e, A.BinOp):
        p = _PREC[e.op]
        right = p + 1
        left = p + 1 if p == 5 else p
        return f"{expr(e.left, left)} {e.op} {expr(e.right, right)}", p
    if isinstance(e, A.Unary):
        if e.op == "not":
            return f"not {expr(e.operand, 4)}", 4
        return f"-{expr(e.operand, 8)}", 8
    if isinstance(e, A.Call):
        return f"{e.func}({', '.join(arg(a) for a in e.args)})", 9
    if isinstance(e, A.Index):
        return f"{expr(e.base, 9)}[{expr(e.index)}]", 9
    raise TypeError(f"not an expression: {e!r}")  # pragma: no cover


def arg(a: A.Arg) -> str:
    return expr(a.value) if a.name is None else f"{a.name}={expr(a.value)}"


# ================================================================ selectors, places, units

def selector(s: A.Selector, prec: int = 0) -> str:
    text, own = _selector(s)
    return f"({text})" if own < prec else text


def _selector(s: A.Selector) -> tuple[str, int]:
    if isinstance(s, A.SelBin):
        if s.op == "except":
            return f"{selector(s.left, 2)} except {selector(s.right, 2)}", 1
        if s.op == "|":
            return f"{selector(s.left, 2)} | {selector(s.right, 3)}", 2
        return f"{selector(s.left, 3)} & {selector(s.right, 4)}", 3
    if isinstance(s, A.SelPath):
        return ".".join(_segment(x) for x in s.segments), 4
    if isinstance(s, A.SelAll):
        return "all", 4
    if isinstance(s, A.SelRest):
        return "rest", 4
    if isinstance(s, A.SelKind):
        return f"kind({', '.join(s.kinds)})", 4
    if isinstance(s, A.SelStage):
        return f"{s.group}[{expr(s.index)}]", 4
    if isinstance(s, A.SelPart):
        idx = expr(s.index[0]) if len(s.index) == 1 else \
            "(" + ", ".join(expr(i) for i in s.index) + ")"
        return f"part {idx} of {selector(s.base, 4)}", 4
    raise TypeError(f"not a selector: {s!r}")  # pragma: no cover


def _segment(seg: A.Segment) -> str:
    if seg.kind in ("name", "index"):
        return str(seg.value)
    if seg.kind == "star":
        return "*"
    if seg.kind == "starstar":
        return "**"
    if seg.kind == "range":
        lo, hi, inclusive = seg.value
        return f"{lo}{'..=' if inclusive else '..'}{hi}"
    return "{" + expr(seg.value) + "}"


def place(p: A.Place) -> str:
    if isinstance(p, A.PlaceDevice):
        return f"device {expr(p.device)}"
    if isinstance(p, A.PlaceDevices):
        return f"devices {expr(p.devices)}"
    if not p.coords:
        return f"mesh {p.mesh}"
    coords = []
    for c in p.coords:
        value = "*" if c.value is None else expr(c.value)
        coords.append(value if c.axis is None else f"{c.axis}={value}")
    return f"{p.mesh}[{', '.join(coords)}]"


def unit(u: A.SeqItem) -> str:
    if isinstance(u, A.Interleave):
        return f"interleave({', '.join(unit(x) for x in u.items)})"
    if u.pass_ is None:
        return selector(u.selector)
    mb = f" mb {expr(u.mb)}" if u.mb is not None else ""
    return f"{u.pass_} {selector(u.selector)}{mb}"


def format_params(params: tuple[A.Param, ...]) -> str:
    """``a: int = 1, b: float`` as the header writes them."""
    return ", ".join(f"{p.name}: {p.type}" + (f" = {expr(p.default)}" if p.default else "")
                     for p in params)


# ================================================================ statements

def simple(s: A.Stmt) -> str:
    """A one-line statement."""
    if isinstance(s, A.Let):
        return f"let {s.name} = {expr(s.value)}"
    if isinstance(s, A.Partition):
        return f"partition {selector(s.selector)} along {s.dim} into {expr(s.count)}"
    if isinstance(s, A.Replicate):
        return f"replicate {selector(s.selector)} into {expr(s.count)}"
    if isinstance(s, A.Assign):
        return f"assign {selector(s.selector)} to {place(s.place)}"
    if isinstance(s, A.AssignEach):
        names = f"({', '.join(s.vars)})" if s.parenthesized else s.vars[0]
        of = f" of {selector(s.of, 4)}" if s.of is not None else ""
        space = f" in {expr(s.space)}" if s.space is not None else ""
        return f"assign each part {names}{of}{space} to {place(s.place)}"
    if isinstance(s, A.OrderBefore):
        return "order " + " before ".join(unit(u) for u in s.units)
    if isinstance(s, A.Microbatch):
        return f"microbatch along {s.dim} into {expr(s.count)}"
    if isinstance(s, A.Stages):
        if s.count is not None:
            over = f" over calls of {selector(s.over)}" if s.over is not None else ""
            return f"stages into {expr(s.count)}{over} as {s.name}"
        splits = s.splits or (None,) * len(s.selectors)
        items = (selector(x) + (f" into {expr(n)}" if n is not None else "")
                 for x, n in zip(s.selectors, splits))
        return f"stages {', '.join(items)} as {s.name}"
    if isinstance(s, A.Recompute):
        return f"recompute {selector(s.selector)}"
    if isinstance(s, A.Zero):
        sel = f" {selector(s.selector)}" if s.selector is not None else ""
        stage = f" stage {expr(s.stage)}" if s.stage is not None else ""
        return f"zero{sel} over {place(s.place)}{stage}"
    if isinstance(s, A.Mesh):
        axes = ", ".join(f"{a.name}={expr(a.size)}" for a in s.axes)
        origin = f" from {expr(s.origin)}" if s.origin is not None else ""
        return f"mesh {s.name} = grid({axes}){origin}"
    if isinstance(s, A.Use):
        args = f"({', '.join(arg(a) for a in s.args)})" if s.args else ""
        return f"use {s.target_text}{args}"
    if isinstance(s, A.Require):
        msg = f", {expr(s.message)}" if s.message is not None else ""
        return f"require {expr(s.cond)}{msg}"
    raise TypeError(f"not a simple statement: {s!r}")  # pragma: no cover


def _lines(stmts: tuple[A.Stmt, ...], depth: int) -> Iterator[_Line]:
    for s in stmts:
        yield from _stmt_lines(s, depth)


def _stmt_lines(s: A.Stmt, depth: int) -> Iterator[_Line]:
    if isinstance(s, A.For):
        yield _Line(f"for {s.var} in {expr(s.iter)}:", depth, s.span.line, s.header_span.end_line)
        yield from _lines(s.body, depth + 1)
    elif isinstance(s, A.If):
        for i, (cond, body, span) in enumerate(s.branches):
            word = "if" if i == 0 else "elif"
            yield _Line(f"{word} {expr(cond)}:", depth, span.line, span.end_line)
            yield from _lines(body, depth + 1)
        if s.orelse is not None:
            yield _Line("else:", depth, s.else_span.line, s.else_span.line)
            yield from _lines(s.orelse, depth + 1)
    elif isinstance(s, A.OrderSeq):
        head = f"order on {place(s.place)}:"
        if not s.block:
            items = ", ".join(unit(u) for u in s.lines[0])
            yield _Line(f"{head} {items}", depth, s.span.line, s.span.end_line)
            return
        yield _Line(head, depth, s.span.line, s.place.span.end_line)
        for i, (items, span) in enumerate(zip(s.lines, s.line_spans)):
            comma = "," if i < len(s.lines) - 1 else ""
            yield _Line(", ".join(unit(u) for u in items) + comma, depth + 1, span.line,
                        span.end_line)
    else:
        yield _Line(simple(s), depth, s.span.line, s.span.end_line)


# ================================================================ the file

def format_parsed(parsed: Parsed) -> str:
    """The canonical text of a parsed plan, comments included."""
    plan = parsed.plan
    params = f"({format_params(plan.params)})" if plan.params else ""
    lines = [_Line(f"plan {plan.name}{params}", 0, plan.span.line, plan.span.end_line)]
    if plan.doc_text is not None:
        lines.append(_Line(plan.doc_text, 0, plan.doc_span.line, plan.doc_span.end_line))
    lines.extend(_lines(plan.body, 0))
    tail = _place_comments(lines, parsed)
    return _render(lines, tail, parsed.text)


def _place_comments(lines: list[_Line], parsed: Parsed) -> list[tuple[int, str]]:
    """Attach each comment to a line; returns the comments after the last line."""
    owner: dict[int, int] = {}
    for i, ln in enumerate(lines):
        for src in range(ln.start, ln.end + 1):
            owner.setdefault(src, i)
    starts = [ln.start for ln in lines]
    tail: list[tuple[int, str]] = []
    for c in parsed.comments:
        i = owner.get(c.line)
        if i is not None and lines[i].trailing is None and c.line == lines[i].end:
            lines[i].trailing = c.text
            continue
        if i is None:
            i = bisect.bisect_right(starts, c.line)
            if i == len(lines):
                tail.append((c.line, c.text))
                continue
        lines[i].leading.append((c.line, c.text))
    return tail


def _render(lines: list[_Line], tail: list[tuple[int, str]], text: str) -> str:
    blank = {n for n, t in enumerate(text.splitlines(), start=1) if not t.strip()}
    out: list[str] = []
    prev_end, prev_text = None, ""

    def put(start: int, end: int, depth: int, body: str) -> None:
        nonlocal prev_end, prev_text
        if prev_end is not None and not prev_text.endswith(":") and \
                any(n in blank for n in range(prev_end + 1, start)):
            out.append("")
        out.append(INDENT * depth + body)
        prev_end, prev_text = end, body

    for ln in lines:
        for src, comment in ln.leading:
            put(src, src, ln.depth, comment)
        body = ln.text + (f"  {ln.trailing}" if ln.trailing else "")
        put(ln.start, ln.end, ln.depth, body)
    for src, comment in tail:
        put(src, src, 0, comment)
    return "\n".join(out) + "\n"


class FormatterBug(SsdslError):
    """The formatter's output would not mean what its input meant (never expected)."""


def format_text(text: str, file: str = "<plan>") -> str:
    """The canonical form of plan text; raises if the result would differ in meaning."""
    parsed = parse_text(text, file)
    out = format_parsed(parsed)
    again = parse_text(out, file)
    if strip_spans(again.plan) != strip_spans(parsed.plan) or \
            sorted(c.text for c in again.comments) != sorted(c.text for c in parsed.comments):
        raise FormatterBug(f"formatting {file} would change it; the file was left as it was",
                           file=file, hint="please report this with the file")
    parse_text(text, file)  # the error renderer shows the user's text, not ours
    return out


def strip_spans(node: object) -> object:
    """``node`` with every position removed: two ASTs that mean the same compare equal."""
    if isinstance(node, Span):
        return None
    if isinstance(node, tuple):
        return tuple(strip_spans(x) for x in node)
    if attrs.has(type(node)):
        return (type(node).__name__,) + tuple(
            strip_spans(getattr(node, f.name)) for f in attrs.fields(type(node))
            if "span" not in f.name and f.name not in ("has_parens", "block"))
    return node
