"""``ssdsl plans``: the stdlib plans with their parameters and docstrings."""

from __future__ import annotations

import argparse
from typing import Any

from ssdsl.elaborate import stdlib_plans


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plans", help="list the stdlib plans",
                              description="List the stdlib plans: name, parameters, docstring.")
    p.add_argument("--json", action="store_true", help="print JSON for tools")
    p.set_defaults(func=run)


def param_table(path) -> dict[str, dict[str, Any]]:
    """``{name: {"type": "int", "default": "world"}}`` for the plan in ``path`` (the default as
    the plan writes it: an expression, or null when the parameter has none)."""
    from ssdsl.parse import parse_file
    from ssdsl.parse.format import expr

    params = parse_file(path).plan.params
    return {p.name: {"type": p.type, "default": expr(p.default) if p.default else None}
            for p in params}


def run(args: argparse.Namespace) -> int:
    plans = stdlib_plans()
    if args.json:
        from ssdsl.cli.jsonout import emit
        emit("plans", {"plans": [{"name": p.name, "plan": p.plan_name,
                                  "params": param_table(p.path), "signature": p.params,
                                  "doc": p.doc, "path": str(p.path)} for p in plans]})
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(show_lines=True)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("parameters", overflow="fold")
    table.add_column("description", overflow="fold")
    for p in plans:
        name = p.name if p.name == p.plan_name else f"{p.name}\n({p.plan_name})"
        summary = (p.doc or "").split("\n\n")[0].replace("\n", " ")
        table.add_row(name, p.params.replace(", ", ",\n") or "-", summary)
    Console().print(table, highlight=False)
    return 0
