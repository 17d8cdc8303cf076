"""``ssdsl check [MODEL] PLAN``: elaborate a plan and show its directives.

With a model file first (``model.py``), the plan is also resolved against the model traced on the
meta device, and each operator's parts are listed (``ssdsl.cli._resolve``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ssdsl.elaborate import DEFAULT_WORLD, ElaboratedPlan, elaborate, load_plan
from ssdsl.errors import UsageError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("check", help="check a plan: its directives, or with MODEL its "
                              "parts, communication and programs",
                              description="Elaborate PLAN (a .ssp path or a stdlib plan name) "
                              "and print the flat list of primitive directives; with MODEL, "
                              "apply it to the traced model and print each operator's parts "
                              "and devices and the communication per step, after checking "
                              "every rank's lowered program. Nothing runs.")
    p.add_argument("targets", nargs="+", metavar="[MODEL] PLAN",
                   help="an optional model file (.py), then a plan file or stdlib plan name")
    add_plan_options(p)
    p.add_argument("--json", action="store_true", help="print JSON for tools")
    p.add_argument("--verify", action="store_true",
                   help="with MODEL: run every adapter on random data and simulate one training "
                   "step of all ranks in one process against the plain model")
    p.add_argument("--program", type=int, default=None, metavar="RANK",
                   help="with MODEL: print the lowered program of rank RANK (its text form)")
    p.set_defaults(func=run)


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """``--set`` and ``--world``, shared by every command that takes a plan."""
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="a plan parameter (repeatable); --set world=N sets the device count")
    p.add_argument("--world", type=int, default=None,
                   help=f"number of devices, the built-in name 'world' (default {DEFAULT_WORLD})")


def parse_sets(items: list[str]) -> dict[str, str]:
    """``["a=1", "b=x"]`` to a dict; a malformed item is a usage error."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise UsageError(f"--set {item}: expected NAME=VALUE")
        if name.strip() in out:
            raise UsageError(f"--set {name.strip()} is given twice")
        out[name.strip()] = value.strip()
    return out


def elaborate_from_args(plan_ref: str, args: argparse.Namespace) -> ElaboratedPlan:
    """Load and elaborate ``plan_ref`` with the ``--set``/``--world`` options of ``args``."""
    sets = parse_sets(args.sets)
    world = args.world if args.world is not None else DEFAULT_WORLD
    if args.world is not None and "world" in sets:
        raise UsageError("give the device count once: --world N or --set world=N")
    return elaborate(load_plan(plan_ref), sets=sets, world=world)


def run(args: argparse.Namespace) -> int:
    targets = args.targets
    if len(targets) > 2:
        raise UsageError("check takes [MODEL] PLAN: at most two arguments")
    model = None
    if targets[0].endswith(".py"):
        model = targets[0]
        if len(targets) != 2:
            raise UsageError("check MODEL PLAN: the plan is missing")
    elif len(targets) == 2:
        raise UsageError(f"check [MODEL] PLAN: the model file must end in .py, got {targets[0]}")
    plan = elaborate_from_args(targets[-1], args)
    if args.program is not None and model is None:
        raise UsageError("--program needs a model: ssdsl check MODEL PLAN --program RANK")
    if args.verify and model is None:
        raise UsageError("--verify needs a model: ssdsl check MODEL PLAN --verify")
    if model is not None:
        return _check_with_model(model, plan, args)
    if args.json:
        from ssdsl.cli.jsonout import emit
        emit("check", plan.to_json())
    else:
        print_plan(plan)
    return 0


def _check_with_model(model: str, plan: ElaboratedPlan, args: argparse.Namespace) -> int:
    from ssdsl.cli._resolve import check_model
    return check_model(model, plan, as_json=args.json, verify=args.verify,
                       program=args.program)


def print_plan(plan: ElaboratedPlan) -> None:
    """The directives as a rich table, with the bound parameters above it."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    params = ", ".join(f"{k}={v!r}" for k, v in plan.params) or "no parameters"
    console.print(f"[bold]{plan.name}[/bold] ({plan.file}): world={plan.world}, {params}",
                  highlight=False)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column("directive", overflow="fold")
    table.add_column("from", style="dim", no_wrap=True)
    for i, d in enumerate(plan.directives):
        table.add_row(str(i), str(d), str(d.span))
    console.print(table, highlight=False)
    console.print(f"{len(plan.directives)} directives", style="dim", highlight=False)
