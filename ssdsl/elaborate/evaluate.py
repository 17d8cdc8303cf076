"""Expressions of the plan language, evaluated directly on the AST.

``Evaluator`` is the expression half of the elaborator: ``ev(expr, env)`` and the typed helpers
statements use (``_bool``, ``_int``, ``_count``). A name bound to ``POISON`` (its ``let`` failed)
raises ``Poisoned``, which the statement loop swallows: the first error was already reported.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from ssdsl.elaborate import errors as E
from ssdsl.elaborate.resolve import suggest
from ssdsl.elaborate.values import (BUILTINS, MAX_MATERIALIZE, Range, is_int, is_number, show,
                                    type_name)
from ssdsl.parse import ast as A
from ssdsl.parse.ast import MAX_INT

# The largest count a statement accepts (parts, copies, micro-batches, stages, a mesh axis) and
# the largest world; stated in docs/language.md. It keeps a typo such as `into 1000000000` an
# error at its line instead of minutes of allocation in the phases after this one.
MAX_COUNT = 65_536


class Poisoned(Exception):
    """A statement read a name whose binding failed; its error was already reported."""


POISON = object()
POISON_COUNT = -1  # a count whose statement failed (the micro-batch count): uses are skipped

_ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod}
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
    ">": operator.gt, ">=": operator.ge}


class Evaluator:
    """Evaluates expressions; one dispatch table entry per expression node type."""

    def __init__(self) -> None:
        self._expr: dict[type, Callable[[Any, dict], Any]] = {
            A.Num: lambda e, env: e.value, A.Str: lambda e, env: e.value,
            A.Bool: lambda e, env: e.value, A.Name: self._name, A.ListLit: self._list,
            A.RangeExpr: self._range, A.BinOp: self._binop, A.Unary: self._unary,
            A.Call: self._call, A.Index: self._index}

    def ev(self, e: A.Expr, env: dict) -> Any:
        """The value of expression ``e``."""
        if type(e) is A.Name:  # the most frequent case, without the dispatch
            v = env.get(e.id, POISON)
            if v is not POISON:
                return v
        return self._expr[type(e)](e, env)

    def _name(self, e: A.Name, env: dict) -> Any:
        v = env.get(e.id, POISON)
        if v is POISON:
            if e.id in env:
                raise Poisoned
            raise E.UnknownName(f"unknown name '{e.id}'{suggest(e.id, env)}", e.span)
        return v

    def _list(self, e: A.ListLit, env: dict) -> tuple:
        return tuple(self.ev(x, env) for x in e.items)

    def _range(self, e: A.RangeExpr, env: dict) -> Range:
        lo, hi = self.ev(e.lo, env), self.ev(e.hi, env)
        for v, sub in ((lo, e.lo), (hi, e.hi)):
            if not is_int(v):
                raise E.WrongType(f"a range bound is an int, got {type_name(v)} {show(v)}",
                                  sub.span)
        if e.inclusive:
            hi += 1
        if hi < lo:
            raise E.ReversedRange(f"the range {lo}..{hi} ends before it starts", e.span,
                                  hint="write the smaller bound first")
        if hi == lo and isinstance(e.lo, A.Num) and isinstance(e.hi, A.Num):
            raise E.EmptyRange(f"the range {lo}..{hi} is empty", e.span,
                               hint="a..b stops before b; a..=b includes b")
        return Range(lo, hi)

    def _unary(self, e: A.Unary, env: dict) -> Any:
        v = self.ev(e.operand, env)
        if e.op == "not":
            if not isinstance(v, bool):
                raise E.WrongType(f"'not' needs a bool, got {type_name(v)} {show(v)}",
                                  e.operand.span)
            return not v
        if not is_number(v):
            raise E.WrongType(f"'-' needs a number, got {type_name(v)} {show(v)}", e.operand.span)
        return -v

    def _binop(self, e: A.BinOp, env: dict) -> Any:
        op = e.op
        if op == "and" or op == "or":
            left = self._bool(e.left, env, f"'{op}'")
            if (op == "and") != left:
                return left
            return self._bool(e.right, env, f"'{op}'")
        a, b = self.ev(e.left, env), self.ev(e.right, env)
        if op in _COMPARE:
            return self._compare(e, a, b)
        return self._arith(e, a, b)

    def _compare(self, e: A.BinOp, a: Any, b: Any) -> bool:
        ordered = e.op not in ("==", "!=")
        same = (is_number(a) and is_number(b)) or type_name(a) == type_name(b)
        if not same or (ordered and not (is_number(a) or isinstance(a, str))):
            raise E.WrongType(f"cannot compare {type_name(a)} {show(a)} {e.op} {type_name(b)} "
                              f"{show(b)}", e.span)
        return _COMPARE[e.op](a, b)

    def _arith(self, e: A.BinOp, a: Any, b: Any) -> Any:
        op = e.op
        if not (is_number(a) and is_number(b)):
            if op == "+" and type_name(a) == type_name(b) and isinstance(a, (str, tuple)):
                if len(a) + len(b) > MAX_MATERIALIZE:
                    raise E.WrongValue("this value grows too large", e.span)
                return a + b
            raise E.WrongType(f"cannot apply {op} to {type_name(a)} {show(a)} and "
                              f"{type_name(b)} {show(b)}", e.span)
        if op in ("/", "//", "%") and b == 0:
            raise E.DivisionByZero(f"division by zero ({show(a)} {op} {show(b)})", e.right.span)
        try:
            result = _ARITH[op](a, b)
        except (OverflowError, ValueError) as exc:
            raise E.ArithmeticFault(f"cannot compute {op}: {exc}", e.span) from None
        if isinstance(result, int) and not -MAX_INT - 1 <= result <= MAX_INT:
            raise E.ArithmeticFault(f"this integer is outside the limit of +-{MAX_INT:,} "
                                    "(64 bits)", e.span)
        if isinstance(result, float) and not math.isfinite(result):
            raise E.ArithmeticFault(f"this number is {result}", e.span)
        return result

    def _call(self, e: A.Call, env: dict) -> Any:
        entry = BUILTINS.get(e.func)
        if entry is None:
            raise E.UnknownFunction(f"unknown function '{e.func}'", e.func_span)
        values = [self.ev(a.value, env) for a in e.args]
        try:
            result = entry[2](values, [a.span for a in e.args], e.span)
        except (OverflowError, ValueError) as exc:
            raise E.ArithmeticFault(f"{e.func}(): {exc}", e.span) from None
        if is_int(result) and not -MAX_INT - 1 <= result <= MAX_INT:  # sum(0..10**18), int(1e300)
            raise E.ArithmeticFault(f"{e.func}() gives an integer outside the limit of "
                                    f"+-{MAX_INT:,} (64 bits)", e.span)
        return result

    def _index(self, e: A.Index, env: dict) -> Any:
        base, i = self.ev(e.base, env), self.ev(e.index, env)
        if not isinstance(base, (tuple, Range, str)):
            raise E.WrongType(f"cannot index {type_name(base)} {show(base)}", e.base.span)
        if not is_int(i):
            raise E.WrongType(f"an index is an int, got {type_name(i)} {show(i)}", e.index.span)
        if not 0 <= i < len(base):
            raise E.IndexOutOfRange(f"index {i} is outside 0..{len(base)}", e.index.span,
                                    hint=f"{show(base)} has {len(base)} item"
                                    f"{'' if len(base) == 1 else 's'}: indices 0 to "
                                    f"{len(base) - 1}" if len(base) else "it is empty")
        return base.lo + i if isinstance(base, Range) else base[i]



    def _bool(self, e: A.Expr, env: dict, what: str) -> bool:
        v = self.ev(e, env)
        if not isinstance(v, bool):
            raise E.WrongType(f"{what} needs a bool, got {type_name(v)} {show(v)}", e.span,
                              hint="a comparison makes a bool: x > 0, n % 2 == 0")
        return v

    def _int(self, e: A.Expr, env: dict, what: str) -> int:
        v = self.ev(e, env)
        if not is_int(v):
            raise E.WrongType(f"{what} needs an int, got {type_name(v)} {show(v)}", e.span,
                              hint="int(x) and a // b make an int"
                              if isinstance(v, float) else None)
        return v

    def _count(self, e: A.Expr, env: dict, what: str, *, limit: int | None = None,
               limit_why: str = "") -> int:
        """A count: an int from 1 to ``limit`` (default ``MAX_COUNT``)."""
        n = self._int(e, env, what)
        if n < 1:
            raise E.WrongValue(f"{what} needs a count of at least 1, got {n}", e.span,
                               hint="a count is at least 1 (1: the operators stay whole)"
                               if what != "a mesh axis size" else "a mesh axis has at least "
                               "one coordinate")
        top = MAX_COUNT if limit is None else min(limit, MAX_COUNT)
        if n > top:
            why = limit_why if limit is not None and limit < MAX_COUNT else \
                f"the limit of counts is {MAX_COUNT:,}"
            raise E.CountTooLarge(f"{what} {n:,} is too large: {why}", e.span,
                                  hint=f"at most {top:,} here" + (
                                      " (run with --world N for more)" if limit is not None
                                      and limit < MAX_COUNT else
                                      "; the count must also divide the size of what it "
                                      "splits"))
        return n
