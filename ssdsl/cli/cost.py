"""``ssdsl cost MODEL PLAN --device a100 --world N``: what one training step of a plan would cost.

The model is traced on the meta device (nothing allocated: a 175B model is costed on a laptop),
the plan is applied, scheduled and materialized as for a run, and ``ssdsl.cost`` simulates one
step on the named device profile: step time, pipeline bubble, communication time, and per device
the compute, communication, parameter/gradient/optimizer bytes and peak memory.
"""

from __future__ import annotations

import argparse
from typing import Any

from ssdsl.cli import positive_int
from ssdsl.errors import SsdslError, UsageError

OPTIMIZERS = ("model", "sgd", "momentum", "adamw")
DTYPES = ("float32", "float64", "float16", "bfloat16", "tfloat32")
# ssdsl.cost.profiles.profile_names(), written out: importing ssdsl.cost loads torch, which the
# parser must not (`ssdsl --help` answers at once); a test keeps the two equal.
DEVICES = ("v100", "a100", "h100", "cpu")


def register(subparsers: Any) -> None:
    from ssdsl.cli.check import add_plan_options

    p = subparsers.add_parser("cost", help="predict a plan's step time and memory on a device",
                              description="Trace MODEL on the meta device, apply PLAN and "
                              "simulate one training step on a device profile.")
    p.add_argument("model", metavar="MODEL", help="model file (.py)")
    p.add_argument("plan", metavar="PLAN", help="plan file or stdlib plan name")
    add_plan_options(p)
    p.add_argument("--device", default="a100", choices=DEVICES,
                   help="device profile (default: a100; cpu: measured by bench/bench_cost.py)")
    nodes = p.add_mutually_exclusive_group()
    nodes.add_argument("--per-node", type=int, default=None, metavar="K",
                       help="devices per node (default: the profile's, 8 for GPUs)")
    nodes.add_argument("--nodes", type=int, default=None, help="number of nodes (world / nodes "
                       "devices each)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="compute dtype (default float32; half dtypes keep fp32 master weights)")
    p.add_argument("--optimizer", default="model", choices=OPTIMIZERS,
                   help="optimizer state to count (default: the model file's optimizer)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="global batch size (default: the model file's BATCH_SIZE)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


class BadClusterShape(SsdslError):
    """``--nodes``/``--per-node`` do not describe the devices of ``--world``."""


def run(args: argparse.Namespace) -> int:
    from ssdsl.cli.check import elaborate_from_args
    from ssdsl.cost import Cluster, CostOptions, estimate, profile
    from ssdsl.materialize.program import materialize
    from ssdsl.runtime.job import schedule_plan
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    if not args.model.endswith(".py"):
        raise UsageError(f"cost MODEL PLAN: the model file must end in .py, got {args.model}")
    plan = elaborate_from_args(args.plan, args)
    prof = profile(args.device)
    cluster = Cluster(plan.world, _per_node(args, plan.world, prof.per_node))
    mf = load_model_file(args.model)
    graph = trace(mf, device="meta", batch_size=args.batch_size)
    t, lowered = schedule_plan(graph, plan)
    m = materialize(t, schedule=lowered)
    opts = CostOptions(profile=prof, cluster=cluster, dtype=args.dtype or "float32",
                       optimizer=_optimizer(args.optimizer, mf))
    report = estimate(m, opts)
    if args.json:
        from ssdsl.cli.jsonout import emit
        emit("cost", {"model": args.model, "plan": plan.name, "world": plan.world,
                      "params": {k: v if isinstance(v, (int, float, bool, str)) else str(v)
                                 for k, v in plan.params}, **report.to_json()})
    else:
        _print(args.model, plan.name, report)
    return 0


def _per_node(args: argparse.Namespace, world: int, default: int) -> int:
    if args.nodes is not None:
        if args.nodes < 1 or world % args.nodes:
            raise BadClusterShape(f"--nodes {args.nodes} does not divide --world {world}",
                                  hint="give a node count that divides the world size")
        return world // args.nodes
    if args.per_node is not None:
        if args.per_node < 1:
            raise BadClusterShape(f"--per-node {args.per_node}: must be at least 1")
        return args.per_node
    return default


def _optimizer(kind: str, mf: Any) -> str:
    """The optimizer state kind: the flag's, or the model file's optimizer by its class."""
    if kind != "model":
        return kind
    import torch
    probe = mf.make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    name = type(probe).__name__.lower()
    if name == "sgd":
        return "momentum" if probe.param_groups[0].get("momentum", 0) else "sgd"
    return "adamw"  # Adam-style: two moments per element (the common case, and an upper bound)


def _gb(x: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.3g} B"


def _ms(x: float) -> str:
    return f"{x * 1e3:.4g} ms"


def _print(model: str, plan: str, r: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    o = r.options
    console = Console(highlight=False, width=max(120, Console().width))
    console.print(f"[bold]{plan}[/bold] on {model}: {o.cluster.world} x {o.profile.name} "
                  f"({o.cluster.per_node} per node), {o.dtype}, {o.optimizer}")
    console.print(f"step {_ms(r.step_time)} = pipeline {_ms(r.makespan)} (bubble "
                  f"{r.bubble:.1%}) + gradient all-reduce {_ms(r.reducer_time)} + optimizer "
                  f"{_ms(r.optimizer_time)}; communication {_ms(r.communication)} per device "
                  f"at most; peak memory {_gb(r.peak_memory)} of {_gb(o.profile.memory)}")
    table = Table(title_justify="left")
    for col in ("device", "compute", "comm", "params", "grads", "optimizer", "activations",
                "peak memory", "TFLOP"):
        table.add_column(col, justify="right")
    for d in r.devices:
        over = d.peak_memory > o.profile.memory
        table.add_row(str(d.device), _ms(d.compute), _ms(d.communication), _gb(d.static.params),
                      _gb(d.static.grads), _gb(d.static.optimizer), _gb(d.peak_activations),
                      _gb(d.peak_memory) + (" (over)" if over else ""), f"{d.flops / 1e12:.3g}",
                      style="red" if over else None)
    console.print(table)
    if r.peak_memory > o.profile.memory:
        console.print(f"does not fit: a device needs {_gb(r.peak_memory)}, the {o.profile.name} "
                      f"has {_gb(o.profile.memory)}", style="red")
    if o.profile.name == "cpu" and "not measured" in o.profile.source:
        console.print("the cpu profile is a default: run bench/bench_cost.py to measure this "
                      "machine", style="yellow")
