"""No phase imports a later phase (docs/architecture.md lists them in order).

The oracle is the phase table below, written from the architecture page, and the import
statements of every module (read with ``ast``, lazy imports inside functions included), not any
code that runs them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ssdsl"

# In processing order (docs/architecture.md). Base modules may be imported by every phase and
# import only base modules.
PHASES = ["parse", "elaborate", "trace", "transform", "schedule", "materialize", "lower", "cost",
          "check", "codegen", "runtime", "api", "cli"]
BASE = {"source", "errors", "resources", "schema", "gcpause", "forking", "ir", "ops", "__init__",
        "__main__", ""}


def _top(name: str) -> str | None:
    if name == "ssdsl":
        return ""
    if not name.startswith("ssdsl."):
        return None
    return name.split(".")[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if node.module == "ssdsl"]
    return out


def _phase_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


MODULES = sorted(PKG.rglob("*.py"))


def test_every_package_is_placed():
    found = {_phase_of(p) for p in MODULES}
    assert found <= set(PHASES) | BASE, sorted(found - set(PHASES) - BASE)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_import_of_a_later_phase(path):
    mine = _phase_of(path)
    if mine in ("__init__", "__main__"):
        return  # the package front door re-exports the API
    rank = {p: i for i, p in enumerate(PHASES)}
    bad = []
    for line, name in _imports(path):
        other = _top(name)
        if other is None or other == mine:
            continue
        if mine in BASE:
            if other not in BASE:
                bad.append(f"line {line}: base module imports phase {other}")
        elif other not in BASE and rank[other] > rank[mine]:
            bad.append(f"line {line}: {mine} imports the later phase {other} ({name})")
    assert not bad, bad
