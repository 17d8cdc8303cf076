"""Static checks of one parsed plan, before any value is computed.

Walks every statement, including loop bodies that may run zero times and branches that may not be
taken, so a misspelled name is found whatever the parameters are: unknown names and functions
(with the closest spelling suggested), wrong arity of built-ins, unknown parameter types, names
bound twice in one block, and names that would hide a built-in.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from ssdsl.elaborate import errors as E
from ssdsl.elaborate.values import BUILTINS, TYPES, check_arity
from ssdsl.errors import ErrorCollector, SsdslError
from ssdsl.parse import ast as A
from ssdsl.source import Span

BUILTIN_NAMES = ("world",)


def suggest(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ''."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class _Scopes:
    """A stack of blocks; each maps the names bound in it to where."""

    def __init__(self) -> None:
        self.stack: list[dict[str, Span | None]] = [{n: None for n in BUILTIN_NAMES}]

    def known(self) -> set[str]:
        return {n for s in self.stack for n in s}

    def bind(self, name: str, span: Span) -> None:
        if name in BUILTIN_NAMES or name in BUILTINS:
            raise E.ReservedName(f"'{name}' is a built-in name and cannot be rebound", span,
                                 hint="choose another name")
        if name in self.stack[-1]:
            raise E.DuplicateName(f"'{name}' is already bound in this block "
                                  f"(at line {self.stack[-1][name].line})", span,
                                  hint="bindings cannot change; use a new name")
        self.stack[-1][name] = span


class Resolver:
    """Collects the static errors of one plan."""

    def __init__(self) -> None:
        self.errors = ErrorCollector()
        self.scopes = _Scopes()

    def run(self, plan: A.Plan) -> list[SsdslError]:
        self._params(plan.params)
        self._block(plan.body, new_scope=False)
        return self.errors.errors

    # ------------------------------------------------------------ structure
    def _params(self, params: tuple[A.Param, ...]) -> None:
        for p in params:
            with self.errors.catch():
                if p.type not in TYPES:
                    raise E.UnknownType(f"unknown type '{p.type}'{suggest(p.type, TYPES)}",
                                        p.type_span, hint=f"types are {', '.join(TYPES)}")
            if p.default is not None:
                self._expr(p.default)
            with self.errors.catch():
                if p.name in self.scopes.stack[-1] and p.name not in BUILTIN_NAMES:
                    raise E.DuplicateParameter(f"parameter '{p.name}' is declared twice", p.span)
                self.scopes.bind(p.name, p.span)

    def _block(self, body: tuple[A.Stmt, ...], *, new_scope: bool = True,
               bound: tuple[tuple[str, Span], ...] = ()) -> None:
        if new_scope:
            self.scopes.stack.append({})
        for name, span in bound:
            with self.errors.catch():
                self.scopes.bind(name, span)
        for stmt in body:
            self._stmt(stmt)
        if new_scope:
            self.scopes.stack.pop()

    def _stmt(self, s: A.Stmt) -> None:
        if isinstance(s, A.Let):
            self._expr(s.value)
            with self.errors.catch():
                self.scopes.bind(s.name, s.span)
        elif isinstance(s, A.For):
            self._expr(s.iter)
            self._block(s.body, bound=((s.var, s.header_span),))
        elif isinstance(s, A.If):
            for cond, body, _ in s.branches:
                self._expr(cond)
                self._block(body)
            if s.orelse is not None:
                self._block(s.orelse)
        elif isinstance(s, A.AssignEach):
            if s.of is not None:
                self._selector(s.of)
            if s.space is not None:
                self._expr(s.space)
            self.scopes.stack.append({})
            for v in s.vars:
                with self.errors.catch():
                    self.scopes.bind(v, s.span)
            self._place(s.place)
            self.scopes.stack.pop()
        else:
            self._children(s)

    def _children(self, s: A.Stmt) -> None:
        """Statements without bindings: check every expression, selector and place inside."""
        for value in _fields(s):
            self._any(value)

    def _any(self, value: object) -> None:
        if isinstance(value, tuple):
            for v in value:
                self._any(v)
        elif isinstance(value, (A.PlaceDevice, A.PlaceDevices, A.PlaceMesh)):
            self._place(value)
        elif isinstance(value, (A.Unit, A.Interleave, A.Arg, A.MeshAxis)):
            for v in _fields(value):
                self._any(v)
        elif isinstance(value, _SELECTORS):
            self._selector(value)
        elif isinstance(value, _EXPRS):
            self._expr(value)

    # ------------------------------------------------------------ leaves
    def _place(self, p: A.Place) -> None:
        if isinstance(p, A.PlaceMesh):
            for c in p.coords:
                if c.value is not None:
                    self._expr(c.value)
        else:
            self._expr(p.device if isinstance(p, A.PlaceDevice) else p.devices)

    def _selector(self, s: A.Selector) -> None:
        if isinstance(s, A.SelBin):
            self._selector(s.left)
            self._selector(s.right)
        elif isinstance(s, A.SelStage):
            self._expr(s.index)
        elif isinstance(s, A.SelPart):
            for e in s.index:
                self._expr(e)
            self._selector(s.base)
        elif isinstance(s, A.SelPath):
            for seg in s.segments:
                if seg.kind == "expr":
                    self._expr(seg.value)

    def _expr(self, e: A.Expr) -> None:
        with self.errors.catch():
            self._expr_raw(e)

    def _expr_raw(self, e: A.Expr) -> None:
        if isinstance(e, A.Name):
            if e.id not in self.scopes.known():
                raise E.UnknownName(f"unknown name '{e.id}'{suggest(e.id, self.scopes.known())}",
                                    e.span)
        elif isinstance(e, A.Call):
            if e.func not in BUILTINS:
                raise E.UnknownFunction(f"unknown function '{e.func}'{suggest(e.func, BUILTINS)}",
                                        e.func_span, hint="built-ins: " + ", ".join(sorted(BUILTINS)))
            for a in e.args:
                if a.name is not None:
                    raise E.WrongArity(f"{e.func}() takes no keyword arguments", a.span)
                self._expr(a.value)
            check_arity(e.func, len(e.args), e.span)
        elif isinstance(e, (A.BinOp, A.RangeExpr)):
            self._expr(e.left if isinstance(e, A.BinOp) else e.lo)
            self._expr(e.right if isinstance(e, A.BinOp) else e.hi)
        elif isinstance(e, A.Unary):
            self._expr(e.operand)
        elif isinstance(e, A.Index):
            self._expr(e.base)
            self._expr(e.index)
        elif isinstance(e, A.ListLit):
            for item in e.items:
                self._expr(item)


_SELECTORS = (A.SelPath, A.SelAll, A.SelRest, A.SelKind, A.SelStage, A.SelPart, A.SelBin)
_EXPRS = (A.Num, A.Str, A.Bool, A.Name, A.ListLit, A.RangeExpr, A.BinOp, A.Unary, A.Call, A.Index)


def _fields(node: object) -> list[object]:
    return [getattr(node, f.name) for f in node.__attrs_attrs__ if f.name not in ("span",)]


def resolve(plan: A.Plan) -> list[SsdslError]:
    """The static errors of ``plan`` (empty when it is well formed)."""
    try:
        return Resolver().run(plan)
    except RecursionError:
        return [E.ElaborationError("the plan nests too deeply", plan.span)]
