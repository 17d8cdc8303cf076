"""Lark parse tree to the AST of ``ssdsl.parse.ast``: one method per grammar rule or alias."""

from __future__ import annotations

import ast as pyast
from typing import Any

from lark import Token, Transformer, v_args

from ssdsl.parse import ast as A
from ssdsl.parse.errors import BadLiteral
from ssdsl.source import Span


def _tokens(children: list[Any]) -> list[Token]:
    return [c for c in children if isinstance(c, Token)]


def _present(children: list[Any]) -> list[Any]:
    return [c for c in children if c is not None]


@v_args(meta=True)
class Builder(Transformer):
    """Builds AST nodes; ``file`` names the source in every span."""

    def __init__(self, file: str) -> None:
        super().__init__()
        self.file = file

    def _sp(self, meta: Any) -> Span:
        return Span.from_meta(self.file, meta)

    def _tok(self, tok: Token) -> Span:
        return Span.from_meta(self.file, tok)

    # ------------------------------------------------------------ file
    def start(self, meta, ch):
        header = ch[0]
        doc = ch[1] if len(ch) > 1 and isinstance(ch[1], tuple) and ch[1][0] == "doc" else None
        body = tuple(ch[2:] if doc else ch[1:])
        name, params, span, name_span = header
        return A.Plan(name, params, bool(params), doc[1] if doc else None, doc[2] if doc else None,
                      body, span, doc[3] if doc else None, name_span)

    def header(self, meta, ch):
        return (str(ch[0]), tuple(_present(ch[1:])), self._sp(meta), self._tok(ch[0]))

    def param(self, meta, ch):
        return A.Param(str(ch[0]), str(ch[1]), ch[2], self._sp(meta), self._tok(ch[1]))

    def docstring(self, meta, ch):
        text = str(ch[0])
        return ("doc", text[3:-3], text, self._tok(ch[0]))

    # ------------------------------------------------------------ statements
    def let_stmt(self, meta, ch):
        return A.Let(str(ch[0]), ch[1], self._sp(meta))

    def partition(self, meta, ch):
        return A.Partition(ch[0], str(ch[1]), ch[2], self._sp(meta))

    def replicate(self, meta, ch):
        return A.Replicate(ch[0], ch[1], self._sp(meta))

    def assign(self, meta, ch):
        return A.Assign(ch[0], ch[1], self._sp(meta))

    def assign_each(self, meta, ch):
        names, paren = ch[0]
        return A.AssignEach(names, paren, ch[1], ch[2], ch[3], self._sp(meta))

    def index_vars(self, meta, ch):
        return (tuple(str(t) for t in ch), len(ch) > 1)

    def order_before(self, meta, ch):
        return A.OrderBefore(tuple(ch), self._sp(meta))

    def order_seq_line(self, meta, ch):
        place, items = ch
        return A.OrderSeq(place, (items[0],), False, self._sp(meta), (items[1],))

    def order_seq(self, meta, ch):
        place, lines = ch[0], ch[1:]
        spans = tuple(l[1] for l in lines)
        return A.OrderSeq(place, tuple(l[0] for l in lines), True, self._sp(meta).to(spans[-1]),
                          spans)

    def unit_line(self, meta, ch):
        return ch[0]

    def unit_list(self, meta, ch):
        return (tuple(ch), self._sp(meta))

    def interleave(self, meta, ch):
        return A.Interleave(ch[0][0], self._sp(meta))

    def unit(self, meta, ch):
        return A.Unit(str(ch[0]), ch[1], ch[2], self._sp(meta))

    def op_unit(self, meta, ch):
        return A.Unit(None, ch[0], None, self._sp(meta))

    def microbatch(self, meta, ch):
        return A.Microbatch(str(ch[0]), ch[1], self._sp(meta))

    def stages_count(self, meta, ch):
        return A.Stages(ch[0], (), str(ch[1]), self._sp(meta))

    def stages_calls(self, meta, ch):
        return A.Stages(ch[0], (), str(ch[2]), self._sp(meta), over=ch[1])

    def stages_sel(self, meta, ch):
        items = ch[:-1]
        splits = tuple(n for _, n in items) if any(n is not None for _, n in items) else ()
        return A.Stages(None, tuple(sel for sel, _ in items), str(ch[-1]), self._sp(meta),
                        splits=splits)

    def stage_sel(self, meta, ch):
        return (ch[0], ch[1] if len(ch) > 1 else None)

    def recompute(self, meta, ch):
        return A.Recompute(ch[0], self._sp(meta))

    def zero(self, meta, ch):
        return A.Zero(ch[0], ch[1], ch[2], self._sp(meta))

    def mesh(self, meta, ch):
        axes = tuple(c for c in ch[1:] if isinstance(c, A.MeshAxis))
        origin = ch[-1] if not isinstance(ch[-1], A.MeshAxis) else None
        return A.Mesh(str(ch[0]), axes, origin, self._sp(meta))

    def mesh_axis(self, meta, ch):
        return A.MeshAxis(str(ch[0]), ch[1], self._sp(meta))

    def use(self, meta, ch):
        ref = ch[0]
        args = tuple(_present(ch[1:]))
        return A.Use(ref[0], ref[1], ref[2], args, bool(args), self._sp(meta), ref[3])

    def plan_ref(self, meta, ch):
        tok = ch[0]
        if tok.type == "STRING":
            return (_string_value(tok, self.file), True, str(tok), self._tok(tok))
        return (str(tok), False, str(tok), self._tok(tok))

    def require(self, meta, ch):
        return A.Require(ch[0], ch[1], self._sp(meta))

    def for_stmt(self, meta, ch):
        header = self._tok(ch[0]).to(ch[1].span)
        return A.For(str(ch[0]), ch[1], ch[2], self._sp(meta), header)

    def if_stmt(self, meta, ch):
        branches = [(ch[0], ch[1], ch[0].span)]
        orelse, else_span = None, None
        for c in ch[2:]:
            if c is None:
                continue
            if c[0] == "elif":
                branches.append(c[1:])
            else:
                orelse, else_span = c[1], c[2]
        return A.If(tuple(branches), orelse, else_span, self._sp(meta))

    def elif_clause(self, meta, ch):
        return ("elif", ch[0], ch[1], ch[0].span)

    def else_clause(self, meta, ch):
        return ("else", ch[0], self._sp(meta))

    def block(self, meta, ch):
        return tuple(ch)

    # ------------------------------------------------------------ places
    def place_device(self, meta, ch):
        return A.PlaceDevice(ch[0], self._sp(meta))

    def place_devices(self, meta, ch):
        return A.PlaceDevices(ch[0], self._sp(meta))

    def place_mesh(self, meta, ch):
        return A.PlaceMesh(str(ch[0]), tuple(ch[1:]), self._sp(meta), self._tok(ch[0]))

    def place_whole_mesh(self, meta, ch):
        return A.PlaceMesh(str(ch[0]), (), self._sp(meta), self._tok(ch[0]))

    def coord_pos(self, meta, ch):
        return A.MeshCoord(None, ch[0], self._sp(meta))

    def coord_kw(self, meta, ch):
        return A.MeshCoord(str(ch[0]), ch[1], self._sp(meta))

    def coord_star(self, meta, ch):
        return A.MeshCoord(None, None, self._sp(meta))

    # ------------------------------------------------------------ selectors
    def sel_except(self, meta, ch):
        return A.SelBin("except", ch[0], ch[1], self._sp(meta))

    def sel_union(self, meta, ch):
        return A.SelBin("|", ch[0], ch[1], self._sp(meta))

    def sel_inter(self, meta, ch):
        return A.SelBin("&", ch[0], ch[1], self._sp(meta))

    def sel_all(self, meta, ch):
        return A.SelAll(self._sp(meta))

    def sel_rest(self, meta, ch):
        return A.SelRest(self._sp(meta))

    def sel_kind(self, meta, ch):
        return A.SelKind(tuple(str(t) for t in ch), self._sp(meta))

    def sel_stage(self, meta, ch):
        return A.SelStage(str(ch[0]), ch[1], self._sp(meta), self._tok(ch[0]))

    def sel_part(self, meta, ch):
        return A.SelPart(ch[0], ch[1], self._sp(meta))

    def part_index(self, meta, ch):
        return tuple(ch)

    def path(self, meta, ch):
        return A.SelPath(tuple(ch), self._sp(meta))

    def seg_name(self, meta, ch):
        return A.Segment("name", str(ch[0]), self._sp(meta))

    def seg_index(self, meta, ch):
        return A.Segment("index", int(ch[0]), self._sp(meta))

    def seg_star(self, meta, ch):
        return A.Segment("star", None, self._sp(meta))

    def seg_starstar(self, meta, ch):
        return A.Segment("starstar", None, self._sp(meta))

    def seg_range(self, meta, ch):
        return A.Segment("range", (int(ch[0]), int(ch[1]), False), self._sp(meta))

    def seg_range_incl(self, meta, ch):
        return A.Segment("range", (int(ch[0]), int(ch[1]), True), self._sp(meta))

    def seg_expr(self, meta, ch):
        return A.Segment("expr", ch[0], self._sp(meta))

    # ------------------------------------------------------------ expressions
    def range(self, meta, ch):
        return A.RangeExpr(ch[0], ch[1], False, self._sp(meta))

    def range_incl(self, meta, ch):
        return A.RangeExpr(ch[0], ch[1], True, self._sp(meta))

    def or_op(self, meta, ch):
        return A.BinOp("or", ch[0], ch[1], self._sp(meta))

    def and_op(self, meta, ch):
        return A.BinOp("and", ch[0], ch[1], self._sp(meta))

    def not_op(self, meta, ch):
        return A.Unary("not", ch[0], self._sp(meta))

    def neg(self, meta, ch):
        return A.Unary("-", ch[0], self._sp(meta))

    def compare(self, meta, ch):
        return A.BinOp(str(ch[1]), ch[0], ch[2], self._sp(meta))

    def binop(self, meta, ch):
        return A.BinOp(str(ch[1]), ch[0], ch[2], self._sp(meta))

    def index(self, meta, ch):
        return A.Index(ch[0], ch[1], self._sp(meta))

    def call(self, meta, ch):
        return A.Call(str(ch[0]), tuple(_present(ch[1:])), self._sp(meta), self._tok(ch[0]))

    def pos_arg(self, meta, ch):
        return A.Arg(None, ch[0], self._sp(meta))

    def kw_arg(self, meta, ch):
        return A.Arg(str(ch[0]), ch[1], self._sp(meta))

    def int_lit(self, meta, ch):
        text = str(ch[0])
        # compare digits before int(): Python refuses to read more than 4300 digits
        if len(text.lstrip("0")) > len(str(A.MAX_INT)) or int(text) > A.MAX_INT:
            shown = text if len(text) <= 30 else f"{text[:12]}...{text[-6:]} ({len(text)} digits)"
            raise BadLiteral(f"the integer {shown} is larger than the limit {A.MAX_INT:,} "
                             "(2**63 - 1)", self._tok(ch[0]))
        return A.Num(int(text), text, self._sp(meta))

    def float_lit(self, meta, ch):
        value = float(ch[0])
        if value != value or value in (float("inf"), float("-inf")):
            raise BadLiteral(f"the number {ch[0]} is too large", self._tok(ch[0]))
        return A.Num(value, str(ch[0]), self._sp(meta))

    def str_lit(self, meta, ch):
        return A.Str(_string_value(ch[0], self.file), str(ch[0]), self._sp(meta))

    def true_lit(self, meta, ch):
        return A.Bool(True, self._sp(meta))

    def false_lit(self, meta, ch):
        return A.Bool(False, self._sp(meta))

    def name(self, meta, ch):
        return A.Name(str(ch[0]), self._sp(meta))

    def list_lit(self, meta, ch):
        return A.ListLit(tuple(_present(ch)), self._sp(meta))


def _string_value(tok: Token, file: str) -> str:
    """The value of a string literal; escapes are Python's, read without running any code."""
    try:
        value = pyast.literal_eval(str(tok))
    except (ValueError, SyntaxError) as exc:
        raise BadLiteral(f"cannot read the string {tok}: {exc}", Span.from_meta(file, tok)) from None
    if not isinstance(value, str):  # pragma: no cover - the token regex only admits strings
        raise BadLiteral(f"{tok} is not a string", Span.from_meta(file, tok))
    return value
