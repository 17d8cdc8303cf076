"""Phase 2, elaborate: a parsed plan to the flat list of primitive directives.

>>> from ssdsl.parse import parse_text
>>> plan = elaborate(parse_text("plan dp(n: int = world)\\n"
...                             "partition all along batch into n\\n"
...                             "assign each part i to device i\\n", "dp.ssp"), world=2)
>>> [str(d) for d in plan.directives]
['partition all along batch into 2', 'assign part 0 of all to device 0', \
'assign part 1 of all to device 1']

Parameters are bound (``args`` as language values, or ``sets`` as command-line strings read by
the parameter's type), loops unrolled and ``use`` inlined; everything that can be checked without
a model is checked, and all independent errors are raised together (``ErrorGroup``).
"""

from __future__ import annotations

import ast as pyast
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssdsl.elaborate import directives
from ssdsl.elaborate.directives import ElaboratedPlan
from ssdsl.elaborate.engine import DEFAULT_MAX_STEPS, Elaborator, _Abort
from ssdsl.elaborate.evaluate import MAX_COUNT
from ssdsl.parse.ast import MAX_INT
from ssdsl.elaborate.errors import BadSetValue, ElaborationError, UnknownParameter, UnknownPlan
from ssdsl.elaborate.loader import (PlanLoader, display_name, find_stdlib, stdlib_plans)
from ssdsl.elaborate.resolve import resolve, suggest
from ssdsl.elaborate.values import convert
from ssdsl.errors import ErrorGroup, SsdslError, UsageError
from ssdsl.parse import Parsed, parse_file, parse_text
from ssdsl.parse import ast as A

__all__ = ["elaborate", "elaborate_file", "elaborate_text", "find_plan", "load_plan",
           "stdlib_plans", "directives", "ElaboratedPlan", "DEFAULT_WORLD"]

DEFAULT_WORLD = 1


def find_plan(ref: str) -> Path:
    """The file of a plan given on the command line: an existing path, or a stdlib name."""
    path = Path(ref)
    if path.is_file():
        return path
    if ref.endswith(".ssp") or "/" in ref:
        raise UnknownPlan(f"no plan file '{ref}'", file=ref)
    found = find_stdlib(ref)
    if found is None:
        names = [p.name for p in stdlib_plans()]
        raise UnknownPlan(f"'{ref}' is neither a plan file nor a stdlib plan{suggest(ref, names)}",
                          hint="stdlib plans: " + ", ".join(names))
    return found


def load_plan(ref: str) -> Parsed:
    """Parse the plan a command-line reference names."""
    path = find_plan(ref)
    return parse_file(path, name=display_name(path))


def elaborate_file(ref: str | Path, **kwargs: Any) -> ElaboratedPlan:
    """``elaborate`` of the plan at a path or with a stdlib name."""
    return elaborate(load_plan(str(ref)), **kwargs)


def elaborate_text(text: str, file: str = "<plan>", **kwargs: Any) -> ElaboratedPlan:
    """``elaborate`` of plan text."""
    return elaborate(parse_text(text, file), **kwargs)


def elaborate(parsed: Parsed, *, args: Mapping[str, Any] | None = None,
              sets: Mapping[str, str] | None = None, world: int = DEFAULT_WORLD,
              max_steps: int = DEFAULT_MAX_STEPS) -> ElaboratedPlan:
    """Elaborate a parsed plan.

    ``args``: parameter values as language values (int, float, bool, str, tuple); ``sets``:
    ``--set`` strings, read by each parameter's declared type (``world`` among them sets the
    number of devices); ``world``: the number of devices (the built-in name ``world``).
    """
    sets = dict(sets or {})
    if "world" in sets:
        world = _read_world(sets.pop("world"))
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise UsageError(f"world must be a positive integer, got {world!r}")
    if world > MAX_COUNT:
        raise UsageError(f"world {world:,} is beyond the limit of {MAX_COUNT:,} devices")
    static = resolve(parsed.plan)
    if static:
        raise ErrorGroup(static) if len(static) > 1 else static[0]
    loader = PlanLoader()
    path = Path(parsed.file)
    if path.is_file():
        loader.register(parsed.file, path)
    el = Elaborator(world=world, loader=loader, max_steps=max_steps)
    given = {k: (v, None) for k, v in (args or {}).items()}
    try:
        given.update(_read_sets(parsed.plan, sets))
        env = el.bind(parsed.plan, given, None)
        if not el.errors:
            el.run_plan(parsed, env)
    except _Abort:
        pass
    except SsdslError as err:
        el.errors.append(err)
    except RecursionError:
        el.errors.append(ElaborationError("the plan nests too deeply", parsed.plan.span))
    if el.errors:
        raise el.errors[0] if len(el.errors) == 1 else ErrorGroup(el.errors)
    params = tuple((p.name, env[p.name]) for p in parsed.plan.params)
    return ElaboratedPlan(parsed.plan.name, parsed.file, parsed.plan.doc, world, params,
                          tuple(el.out))


def _read_world(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--set world={text}: world is the number of devices, an integer") \
            from None


def _read_sets(plan: A.Plan, sets: Mapping[str, str]) -> dict[str, tuple[Any, Any]]:
    """``--set`` strings as values of the declared parameter types, errors located in the plan."""
    params = {p.name: p for p in plan.params}
    out = {}
    for name, text in sets.items():
        p = params.get(name)
        if p is None:
            raise UnknownParameter(f"--set {name}=...: plan '{plan.name}' has no parameter "
                                   f"'{name}'{suggest(name, params)}", plan.name_span,
                                   hint="parameters: " + (", ".join(params) or "none"))
        out[name] = (_read_value(p, text), p.span)
    return out


def _read_value(p: A.Param, text: str) -> Any:
    value: Any
    try:
        if p.type == "int":
            value = int(text)
        elif p.type == "float":
            value = float(text)
        elif p.type == "bool":
            value = {"true": True, "false": False}[text.strip().lower()]
        elif p.type == "str":
            value = text
        else:
            value = _as_list(pyast.literal_eval(text))
    except (ValueError, KeyError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise BadSetValue(f"--set {p.name}={text[:40]}: the integer is outside the limit of "
                          f"+-{MAX_INT:,} (64 bits)", p.span)
    if value is None or convert(value, p.type) is None:
        shown = text if len(text) <= 40 else text[:37] + "..."
        article = "an" if str(p.type)[:1] in "aeiou" else "a"
        raise BadSetValue(f"--set {p.name}={shown}: '{shown}' is not {article} {p.type}", p.span,
                          hint=f"parameter '{p.name}' is declared {p.type}")
    return convert(value, p.type)


def _as_list(value: Any) -> tuple | None:
    if not isinstance(value, (list, tuple)):
        return None
    items = []
    for v in value:
        if isinstance(v, (list, tuple)):
            v = _as_list(v)
        elif not isinstance(v, (int, float, str, bool)):
            return None
        items.append(v)
    return tuple(items)
