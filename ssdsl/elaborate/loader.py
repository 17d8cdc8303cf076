"""Finding and loading plans: by path, or by stdlib name.

A plan reference is resolved in this order:

1. a path (``use "other.ssp"``, or on the command line anything that exists or ends in ``.ssp``),
   relative to the file that uses it;
2. ``NAME.ssp`` beside the file that uses it;
3. a stdlib plan whose file is ``NAME.ssp`` (``1f1b``), or whose header declares ``plan NAME``
   (``one_f_one_b``).

Parsed plans are cached per path (and modification time) with their static errors.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import attrs

from ssdsl.elaborate.errors import UnknownPlan
from ssdsl.elaborate.resolve import resolve, suggest
from ssdsl.errors import ErrorGroup, SsdslError
from ssdsl.parse import Parsed, parse_file
from ssdsl.resources import stdlib_dir
from ssdsl.source import Span


@attrs.frozen
class StdlibPlan:
    """One stdlib plan, as ``ssdsl plans`` lists it."""

    name: str  # the file stem, what users type: 1f1b
    plan_name: str  # the name in its header: one_f_one_b
    path: Path
    params: str  # "stages: int = world, ..." as written
    doc: str | None


def display_name(path: Path) -> str:
    """The name a plan file has in spans and messages: relative to the working directory when
    it lies below it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


@cache
def stdlib_plans() -> tuple[StdlibPlan, ...]:
    """Every stdlib plan, sorted by name."""
    from ssdsl.parse.format import format_params

    out = []
    for path in sorted(stdlib_dir().glob("*.ssp")):
        parsed = parse_file(path, name=display_name(path))
        plan = parsed.plan
        doc = plan.doc.strip() if plan.doc else None
        out.append(StdlibPlan(path.stem, plan.name, path, format_params(plan.params), doc))
    return tuple(out)


def find_stdlib(name: str) -> Path | None:
    """The stdlib plan with file stem or header name ``name``."""
    direct = stdlib_dir() / f"{name}.ssp"
    if direct.is_file():
        return direct
    for p in stdlib_plans():
        if p.plan_name == name:
            return p.path
    return None


class PlanLoader:
    """Resolves plan references and caches parsed plans (with their static errors)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[float, Parsed, list[SsdslError]]] = {}
        self._names: dict[str, Path] = {}

    def find(self, target: str, *, is_path: bool, relative_to: str | None,
             span: Span | None) -> str:
        """The display name of the plan file ``target`` refers to."""
        base = self._names[relative_to].parent if relative_to in self._names else Path.cwd()
        path = self._locate(target, is_path, base)
        if path is None:
            known = [p.name for p in stdlib_plans()] + [p.plan_name for p in stdlib_plans()]
            what = f"file '{target}'" if is_path else f"plan '{target}'"
            raise UnknownPlan(f"unknown {what}{'' if is_path else suggest(target, known)}", span,
                              hint="stdlib plans: " + ", ".join(p.name for p in stdlib_plans()))
        name = display_name(path)
        self._names[name] = path
        return name

    def _locate(self, target: str, is_path: bool, base: Path) -> Path | None:
        if is_path:
            path = Path(target) if Path(target).is_absolute() else base / target
            return path if path.is_file() else None
        beside = base / f"{target}.ssp"
        if beside.is_file():
            return beside
        return find_stdlib(target)

    def load(self, name: str) -> Parsed:
        """The parsed plan ``name`` (from ``find``); raises its static errors, if any."""
        path = self._names[name]
        mtime = path.stat().st_mtime
        hit = self._cache.get(name)
        if hit is None or hit[0] != mtime:
            parsed = parse_file(path, name=name)
            hit = (mtime, parsed, resolve(parsed.plan))
            self._cache[name] = hit
        if hit[2]:
            raise hit[2][0] if len(hit[2]) == 1 else ErrorGroup(hit[2])
        return hit[1]

    def register(self, name: str, path: Path) -> None:
        """Make a file known under ``name`` (the top plan, found by the caller)."""
        self._names[name] = path
