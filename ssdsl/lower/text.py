"""The text form of per-rank programs: one instruction per line, read back by ``parse_program``.

Each line is ``kind(field=value, ...)`` with fields that differ from their default, values
written as Python literals plus a few constructors (``R`` a region, ``S`` a call slot,
``LocalCall``, ``Coll``, ``P2P``, ``Msg``, ``Span``, ``torch.float32``...). The head line names
the rank and the world. ``parse_program(program_text(p)) == p`` for every lowered program.

    program rank 1 of 2
    begin(unit='0F0', span=Span('1f1b.ssp', 9, 5, 9, 40))
    comm(edge=3, mb=0, backward=False, ins=(), outs=('add>mm.0@0',), ...)
"""

from __future__ import annotations

import ast
import functools
import math
from typing import Any

import attrs
import torch

from ssdsl.errors import SsdslError
from ssdsl.ir.region import Region, by_identity
from ssdsl.lower.instr import BY_KIND, Coll, Msg, P2P, Program
from ssdsl.ops.core import LocalCall, Slot
from ssdsl.source import Span


class ProgramTextError(SsdslError):
    """A program text that does not read back (a line that is not an instruction)."""


_CLASSES: dict[str, Any] = {"LocalCall": LocalCall, "Coll": Coll, "P2P": P2P, "Msg": Msg,
                            "Span": Span}


def program_text(p: Program) -> str:
    """The text form of ``p`` (ends with a newline)."""
    lines = [f"program rank {p.rank} of {p.world}"]
    lines += [instruction_text(i) for i in p.instructions]
    return "\n".join(lines) + "\n"


def instruction_text(ins: Any, *, without_span: bool = False) -> str:
    """One line: ``kind(field=value, ...)``, fields at their default left out (and the span,
    with ``without_span``: the text of ``attrs.evolve(ins, span=None)``)."""
    return f"{ins.kind}({_fields(ins, 'span' if without_span else None)})"


def _fields(obj: Any, skip: str | None = None) -> str:
    return _renderer(type(obj), skip)(obj)


def field_texts(ins: Any, *, without_span: bool = False,
                like: tuple[Any, tuple[str | None, ...]] | None = None
                ) -> tuple[str | None, ...]:
    """Each field of ``ins`` as ``instruction_text`` writes it (None: left out), in field
    order. ``like``: another instruction of the same class and its field texts, whose text is
    taken for every field that holds the very same object (a program stamped from another
    shares most of its values with it)."""
    skip = "span" if without_span else None
    if like is not None and type(like[0]) is type(ins):
        return _like_renderer(type(ins), skip)(ins, like[0], like[1])
    return _like_renderer(type(ins), skip)(ins, None, None)


@functools.cache
def _like_renderer(cls: type, skip: str | None) -> Any:
    """``field_texts`` of ``cls``, written out once per class (as ``_renderer``)."""
    env: dict[str, Any] = {"_lit": _lit}
    names = _named_defaults(cls, skip)
    lines = ["def render(obj, base, texts):", "    out = []"]
    for i, (name, default) in enumerate(names):
        lines.append(f"    v = obj.{name}")
        lines.append(f"    if base is not None and base.{name} is v:")
        lines.append(f"        out.append(texts[{i}])")
        put = f"out.append({name + '='!r} + _lit(v))"
        if default is attrs.NOTHING:
            lines.append(f"    else:\n        {put}")
        else:
            env[f"d{i}"], env[f"t{i}"] = default, type(default)
            lines.append(f"    elif type(v) is t{i} and v == d{i}:\n        out.append(None)")
            lines.append(f"    else:\n        {put}")
    lines.append("    return tuple(out)")
    exec("\n".join(lines), env)  # noqa: S102 - text made here from the class's field names
    return env["render"]


def text_of_fields(ins: Any, texts: tuple[str | None, ...]) -> str:
    """The line ``instruction_text`` writes, from ``field_texts``."""
    return f"{ins.kind}({', '.join(t for t in texts if t is not None)})"


@functools.cache
def _named_defaults(cls: type, skip: str | None) -> tuple[tuple[str, Any], ...]:
    return tuple((n, d) for n, d in _defaults(cls) if n != skip)


@functools.cache
def _renderer(cls: type, skip: str | None) -> Any:
    """``cls``'s fields as text, written out once per class: each field (``skip`` left out),
    unless it is at its default (same type and equal), as ``name=<_lit of it>``."""
    env: dict[str, Any] = {"_lit": _lit}
    lines = ["def render(obj):", "    out = []"]
    for i, (name, default) in enumerate(_defaults(cls)):
        if name == skip:
            continue
        lines.append(f"    v = obj.{name}")
        put = f"    out.append({name + '='!r} + _lit(v))"
        if default is attrs.NOTHING:
            lines.append(put)
        else:
            env[f"d{i}"], env[f"t{i}"] = default, type(default)
            lines += [f"    if not (type(v) is t{i} and v == d{i}):", "    " + put]
    lines.append('    return ", ".join(out)')
    exec("\n".join(lines), env)  # noqa: S102 - text made here from the class's field names
    return env["render"]


@functools.cache
def _defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """Each field of ``cls`` with the default its text leaves out (``NOTHING``: none)."""
    return tuple((f.name, attrs.NOTHING if isinstance(f.default, attrs.Factory) else f.default)
                 for f in attrs.fields(cls))


# Regions and spans recur across the instructions of every rank (a 1,024-rank plan writes
# millions of them); their fields are ints and strings, so equal values have equal text and
# caching by value is exact (not so for calls: ``1 == 1.0 == True`` would share a text).
_REGION_BY_ID: dict[int, tuple[Region, str]] = {}  # the few region objects, asked again and again


def _region_lit(v: Region) -> str:
    return by_identity(_REGION_BY_ID, v, _region_value_lit)


@functools.lru_cache(maxsize=1 << 16)
def _region_value_lit(v: Region) -> str:
    return f"R({_lit(v.shape)}, {_lit(v.intervals)}, {_lit(v.part)})"


@functools.lru_cache(maxsize=1 << 12)
def _span_lit(v: Span) -> str:  # ``via`` is not part of a span's text nor of its equality
    return f"Span({v.file!r}, {v.line}, {v.column}, {v.end_line}, {v.end_column})"


# A call or a step is one object shared by every micro-batch (and often by ranks alike) but
# compares equal to ones of other text (``1 == 1.0``): cached by identity, the object kept alive
# with its text so that its id is not reused while cached.
_BY_ID: dict[int, tuple[Any, str]] = {}


def _object_lit(v: Any) -> str:
    hit = _BY_ID.get(id(v))
    if hit is not None and hit[0] is v:
        return hit[1]
    text = f"{type(v).__name__}({_fields(v)})"
    if len(_BY_ID) >= 1 << 16:
        _BY_ID.clear()
    _BY_ID[id(v)] = (v, text)
    return text


def _lit(v: Any) -> str:
    plain = _PLAIN.get(type(v))  # the common exact types first; anything else below
    if plain is not None:
        return plain(v)
    if isinstance(v, Slot):
        return f"S({v.index})"
    if isinstance(v, Region):
        return _region_lit(v)
    if isinstance(v, Span):
        return _span_lit(v)
    if isinstance(v, (LocalCall, Coll, P2P, Msg)):
        return _object_lit(v)
    if isinstance(v, tuple):
        inner = ", ".join(_lit(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if isinstance(v, list):
        return "[" + ", ".join(_lit(x) for x in v) + "]"
    if isinstance(v, float) and not math.isfinite(v):
        return f"float('{v}')"
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, torch.device):
        return f"device({str(v)!r})"
    if isinstance(v, (torch.dtype, torch.memory_format, torch.layout)):
        return str(v)
    raise TypeError(f"no text form for {v!r} ({type(v).__name__})")


def _tuple_lit(v: tuple) -> str:
    inner = ", ".join(_lit(x) for x in v)
    return f"({inner},)" if len(v) == 1 else f"({inner})"


# A collective's fields are a kind, ints and a tuple of ints: equal values, equal text, so
# cached by value (the members of a group share each text; a stamped program makes its own
# objects). One of other types (``True == 1``) goes by identity, as calls do.
def _coll_lit(v: Coll) -> str:
    if type(v.kind) is str and type(v.group) is tuple and type(v.dim) is int \
            and type(v.cat_dim) is int and type(v.split_dim) is int \
            and all(type(x) is int for x in v.group):
        return _plain_coll_lit(v)
    return _object_lit(v)


@functools.lru_cache(maxsize=1 << 14)
def _plain_coll_lit(v: Coll) -> str:
    return f"Coll({_fields(v)})"


# Exact types whose text ``_lit`` gives without further tests (a subclass goes the long way).
_PLAIN: dict[type, Any] = {str: repr, int: repr, bool: repr, type(None): repr,
                           tuple: _tuple_lit, Region: _region_lit, Span: _span_lit,
                           LocalCall: _object_lit, Coll: _coll_lit, P2P: _object_lit,
                           Msg: _object_lit}


def parse_program(text: str, *, name: str = "<program>") -> Program:
    """Read the form ``program_text`` writes."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ProgramTextError(f"{name}: empty program text")
    head = lines[0].split()
    if len(head) != 5 or head[:2] != ["program", "rank"] or head[3] != "of":
        raise ProgramTextError(f"{name}:1: expected 'program rank R of W', got {lines[0]!r}")
    instructions = tuple(parse_instruction(ln, where=f"{name}:{i + 2}")
                         for i, ln in enumerate(lines[1:]))
    return Program(int(head[2]), int(head[4]), instructions)


def parse_instruction(line: str, *, where: str = "<line>") -> Any:
    """One instruction from its line."""
    try:
        node = ast.parse(line.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in BY_KIND and not node.args):
            raise ValueError("not kind(field=value, ...)")
        cls = BY_KIND[node.func.id]
        return cls(**{k.arg: _eval(k.value) for k in node.keywords})
    except (SyntaxError, ValueError, TypeError) as err:
        raise ProgramTextError(f"{where}: cannot read instruction {line.strip()!r}: {err}") \
            from None


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_eval(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [_eval(e) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "torch":
        value = getattr(torch, node.attr, None)
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            return value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        fn = node.func.id
        args = [_eval(a) for a in node.args]
        kwargs = {k.arg: _eval(k.value) for k in node.keywords}
        if fn == "S":
            return Slot(*args)
        if fn == "R":
            return Region(*args)
        if fn == "float" and len(args) == 1 and isinstance(args[0], str):
            return float(args[0])
        if fn == "device":
            return torch.device(*args)
        if fn in _CLASSES:
            return _CLASSES[fn](*args, **kwargs)
    raise ValueError(f"unexpected {ast.dump(node)[:60]}")
