"""Where the grammar and the stdlib plans live, in a checkout and in an installed wheel.

In the repository they sit at the top (``grammar/``, ``stdlib_plans/``); a wheel carries copies
inside the package (``ssdsl/_grammar``, ``ssdsl/_stdlib_plans``, see ``pyproject.toml``). The
packaged copy wins when it exists, so a non-editable install never reads a stray checkout.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _locate(packaged: str, top: str) -> Path:
    inside = _PACKAGE / packaged
    if inside.is_dir():
        return inside
    beside = _PACKAGE.parent / top
    if beside.is_dir():
        return beside
    raise FileNotFoundError(f"ssdsl installation is incomplete: neither {inside} nor {beside} exists")


@cache
def grammar_dir() -> Path:
    """The folder holding ``ssp.lark``."""
    return _locate("_grammar", "grammar")


@cache
def stdlib_dir() -> Path:
    """The folder holding the stdlib ``.ssp`` plans."""
    return _locate("_stdlib_plans", "stdlib_plans")
