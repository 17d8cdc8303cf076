"""Values of the plan language and its built-in functions.

Values are plain Python: ``int``, ``float``, ``bool``, ``str``, ``tuple`` (a list) and ``Range``.
A plan cannot run Python: the built-ins below are the only functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from ssdsl.elaborate.errors import WrongArity, WrongType, WrongValue
from ssdsl.source import Span

TYPES = ("int", "float", "bool", "str", "list")

# Values larger than this are refused where they would allocate (list(0..n)).
MAX_MATERIALIZE = 1_000_000


@attrs.frozen
class Range:
    """The half-open integer range ``lo..hi`` (``a..=b`` is ``Range(a, b + 1)``)."""

    lo: int
    hi: int

    def __len__(self) -> int:
        return max(0, self.hi - self.lo)

    def __iter__(self):
        return iter(range(self.lo, self.hi))

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}"

    def to_json(self) -> dict[str, int]:
        return {"lo": self.lo, "hi": self.hi}


def type_name(value: Any) -> str:
    """The language's name for the type of ``value``."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, tuple):
        return "list"
    if isinstance(value, Range):
        return "range"
    return type(value).__name__  # pragma: no cover - no other values exist


SHOW_LIMIT = 60  # characters of a value quoted in a message (a 400 KB string stays out of it)


def show(value: Any, limit: int = SHOW_LIMIT) -> str:
    """A value as the language would write it, cut after about ``limit`` characters (with
    the full length said), so that a message quoting it stays one short line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value[:limit + 1].replace("\\", "\\\\").replace('"', '\\"')
        if len(value) <= limit and len(text) <= limit:
            return '"' + text + '"'
        return '"' + text[:limit] + f'..." ({len(value):,} characters)'
    if isinstance(value, tuple):
        items, used = [], 0
        for v in value:
            if used > limit:
                return "[" + ", ".join(items) + f", ...] ({len(value):,} items)"
            items.append(show(v, max(8, limit - used)))
            used += len(items[-1]) + 2
        return "[" + ", ".join(items) + "]"
    text = str(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def convert(value: Any, type_: str) -> Any | None:
    """``value`` as a parameter of type ``type_`` (an int is a valid float), or None."""
    name = type_name(value)
    if name == type_:
        return value
    if type_ == "float" and name == "int":
        return float(value)
    if type_ == "list" and name == "range":
        return tuple(value) if len(value) <= MAX_MATERIALIZE else None
    return None


# ---------------------------------------------------------------- built-in functions

Builtin = Callable[[list[Any], list[Span], Span], Any]
BUILTINS: dict[str, tuple[int, int | None, Builtin]] = {}  # name -> (min args, max args, fn)


def builtin(name: str, min_args: int, max_args: int | None):
    """Register a built-in function; ``fn(values, arg_spans, call_span)``."""
    def deco(fn: Builtin) -> Builtin:
        BUILTINS[name] = (min_args, max_args, fn)
        return fn
    return deco


def _numbers(values: list[Any], spans: list[Span], fname: str) -> list[Any]:
    if len(values) == 1 and isinstance(values[0], (tuple, Range)):
        items = list(values[0]) if len(values[0]) <= MAX_MATERIALIZE else None
        if not items:
            raise WrongValue(f"{fname}() of an empty or huge list", spans[0])
        values, spans = items, spans * len(items)
    for v, s in zip(values, spans):
        if not is_number(v):
            raise WrongType(f"{fname}() needs numbers, got {type_name(v)} {show(v)}", s)
    return values


@builtin("min", 1, None)
def _min(values, spans, span):
    return min(_numbers(values, spans, "min"))


@builtin("max", 1, None)
def _max(values, spans, span):
    return max(_numbers(values, spans, "max"))


@builtin("sum", 1, 1)
def _sum(values, spans, span):
    if not isinstance(values[0], (tuple, Range)):
        raise WrongType(f"sum() needs a list or a range, got {type_name(values[0])}", spans[0])
    if isinstance(values[0], Range):
        r = values[0]
        return (r.lo + r.hi - 1) * len(r) // 2
    return sum(_numbers(list(values[0]), spans * len(values[0]), "sum")) if values[0] else 0


@builtin("len", 1, 1)
def _len(values, spans, span):
    if not isinstance(values[0], (tuple, Range, str)):
        raise WrongType(f"len() needs a list, a range or a string, got {type_name(values[0])}",
                        spans[0])
    return len(values[0])


@builtin("abs", 1, 1)
def _abs(values, spans, span):
    return abs(_numbers(values[:1], spans, "abs")[0]) if not isinstance(values[0], (tuple, Range)) \
        else _raise(WrongType(f"abs() needs a number, got {type_name(values[0])}", spans[0]))


@builtin("int", 1, 1)
def _int(values, spans, span):
    v = values[0]
    if is_number(v):
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit() and len(v) < 100:
        return int(v)
    raise WrongType(f"int() needs a number or a string of digits, got {type_name(v)} {show(v)}",
                    spans[0])


@builtin("float", 1, 1)
def _float(values, spans, span):
    v = values[0]
    if is_number(v):
        return float(v)
    raise WrongType(f"float() needs a number, got {type_name(v)} {show(v)}", spans[0])


@builtin("str", 1, 1)
def _str(values, spans, span):
    v = values[0]
    if isinstance(v, str):
        return v
    if is_number(v) and (not isinstance(v, int) or abs(v) < 10 ** 100):
        return str(v)
    if isinstance(v, bool):
        return show(v)
    raise WrongType(f"str() needs a number or a bool, got {type_name(v)}", spans[0])


@builtin("list", 1, 1)
def _list(values, spans, span):
    v = values[0]
    if isinstance(v, tuple):
        return v
    if isinstance(v, Range):
        if len(v) > MAX_MATERIALIZE:
            raise WrongValue(f"list() of a range of {len(v)} values is too large", spans[0])
        return tuple(v)
    raise WrongType(f"list() needs a list or a range, got {type_name(v)}", spans[0])


@builtin("ceil_div", 2, 2)
def _ceil_div(values, spans, span):
    for v, s in zip(values, spans):
        if not is_int(v):
            raise WrongType(f"ceil_div() needs integers, got {type_name(v)}", s)
    if values[1] == 0:
        from ssdsl.elaborate.errors import DivisionByZero
        raise DivisionByZero("ceil_div() by zero", spans[1])
    return -(-values[0] // values[1])


def _raise(err: Exception):
    raise err


def check_arity(name: str, count: int, span: Span) -> None:
    """Raise ``WrongArity`` when built-in ``name`` cannot take ``count`` arguments."""
    lo, hi, _ = BUILTINS[name]
    if count < lo or (hi is not None and count > hi):
        want = f"{lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
        raise WrongArity(f"{name}() takes {want} argument{'s' if want != '1' else ''}, "
                         f"got {count}", span)
