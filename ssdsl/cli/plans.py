"""``ssdsl plans``: the stdlib plans with their parameters and docstrings."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ssdsl.elaborate import stdlib_plans


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plans", help="list the stdlib plans",
                              description="List the stdlib plans: name, parameters, docstring.")
    p.add_argument("--json", action="store_true", help="print JSON for tools")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plans = stdlib_plans()
    if args.json:
        json.dump([{"name": p.name, "plan": p.plan_name, "params": p.params, "doc": p.doc,
                    "path": str(p.path)} for p in plans], sys.stdout, indent=1)
        sys.stdout.write("\n")
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
