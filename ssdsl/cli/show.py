"""``ssdsl show [MODEL] PLAN``: the plan's pipeline schedule as a timeline, in text and as a picture.

The plan is elaborated, its ``microbatch``/``stages``/``assign``/``order`` statements lowered to
per-device programs, checked (errors point at the order statements), and simulated with unit
costs (forward 1, backward 2 unless ``--forward``/``--backward``): the terminal gets a coloured
grid and the figures (bubble, peak activations), ``-o`` gets an SVG (or PNG, via rsvg-convert).
With MODEL, the stages' data dependences (skip edges, forward-only stages) come from the traced
model; the unit costs stay uniform (per-stage costs from MODEL: ``ssdsl cost``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ssdsl.cli.check import add_plan_options, elaborate_from_args
from ssdsl.errors import UsageError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("show", help="draw a plan's pipeline schedule",
                              description="Lower, check and simulate the pipeline schedule of "
                              "PLAN; print it as a timeline and write a picture.")
    p.add_argument("targets", nargs="+", metavar="[MODEL] PLAN",
                   help="an optional model file (.py), then a plan file or stdlib plan name")
    add_plan_options(p)
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="picture to write: .svg, or .png with rsvg-convert (default: PLAN.svg, "
                   "or PLAN-2.svg, ... when that exists: an existing file is never replaced "
                   "unless named with -o and written by ssdsl show)")
    p.add_argument("--no-picture", action="store_true", help="print only; write no file")
    p.add_argument("--forward", type=float, default=1.0,
                   help="cost of a forward unit (default: %(default)g)")
    p.add_argument("--backward", type=float, default=None,
                   help="cost of a backward unit (default: twice --forward)")
    p.add_argument("--latency", type=float, default=0.0,
                   help="time a message takes (default: %(default)g)")
    p.add_argument("--blocking-sends", action="store_true",
                   help="check deadlocks with blocking sends (default: asynchronous, as the "
                        "runtime issues them)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


# Written into every picture, so that ssdsl replaces only files it wrote itself.
MARK = "<!-- written by ssdsl show -->"


def _write_picture(svg: str, out: Path) -> None:
    if out.exists() and MARK not in out.read_text(errors="replace")[:4096] \
            and out.suffix == ".svg":
        raise UsageError(f"-o {out}: the file exists and was not written by ssdsl show; it is "
                         "left as it is", hint="choose another file name with -o")
    if out.suffix == ".png" and out.exists():
        raise UsageError(f"-o {out}: the file exists; ssdsl does not overwrite it",
                         hint="choose another file name with -o")
    svg = svg.replace(">", ">\n" + MARK, 1)
    if out.suffix == ".svg":
        out.write_text(svg)
        return
    if out.suffix != ".png":
        raise UsageError(f"-o {out}: the picture must end in .svg or .png")
    tool = shutil.which("rsvg-convert")
    if tool is None:
        raise UsageError(f"-o {out}: writing PNG needs the rsvg-convert program (librsvg), "
                         "which is not on PATH",
                         hint="install it (apt install librsvg2-bin, brew install librsvg), "
                         "or write .svg")
    done = subprocess.run([tool, "-o", str(out)], input=svg.encode(), capture_output=True)
    if done.returncode != 0:
        raise UsageError(f"-o {out}: rsvg-convert failed: "
                         f"{done.stderr.decode(errors='replace').strip()[:300]}")


def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"


def fresh_name(stem: str, suffix: str = ".svg") -> Path:
    """``stem.svg``, or ``stem-2.svg``, ``stem-3.svg``, ... : the first that does not exist, so
    a picture written without -o never replaces a file in the current directory."""
    out = Path(stem + suffix)
    k = 2
    while out.exists():
        out = Path(f"{stem}-{k}{suffix}")
        k += 1
    return out


def run(args: argparse.Namespace) -> int:
    # Imported here, not with the parser: ssdsl.check loads torch.
    from rich.console import Console

    from ssdsl.check import CommModel, check_schedule
    from ssdsl.schedule.lower import lower_schedule
    from ssdsl.schedule.picture import row_names, timeline_svg, timeline_text
    from ssdsl.schedule.simulate import Costs, simulate

    targets = args.targets
    if len(targets) > 2 or (len(targets) == 2 and not targets[0].endswith(".py")):
        raise UsageError("show takes [MODEL] PLAN, the model file ending in .py")
    if args.output and not args.no_picture and Path(args.output).suffix not in (".svg", ".png"):
        raise UsageError(f"-o {args.output}: the picture must end in .svg or .png")
    plan = elaborate_from_args(targets[-1], args)
    assumed = args.world is None and not any(item.split("=", 1)[0].strip() == "world"
                                             for item in args.sets)
    if len(targets) == 2:
        # with MODEL: the stage DAG and the forward-only stages (a recycling model's first
        # passes) come from the traced graph, as under ``ssdsl check MODEL PLAN`` and ``run``
        from ssdsl.runtime.job import schedule_plan
        from ssdsl.trace import trace
        from ssdsl.trace.model_file import load_model_file
        _, lowered = schedule_plan(trace(load_model_file(targets[0]), device="meta"), plan)
    else:
        lowered = lower_schedule(plan.directives)
    if lowered is None:
        raise UsageError(f"plan '{plan.name}' has no 'stages' statement: there is no pipeline "
                         "schedule to show")
    comm = CommModel.RENDEZVOUS if args.blocking_sends else CommModel.ASYNC
    check_schedule(lowered.schedule, comm=comm)
    costs = Costs(forward=args.forward, backward=args.backward, latency=args.latency)
    result = simulate(lowered.schedule, costs)
    s = lowered.schedule
    title = f"{plan.name}: {_n(s.stages.num_stages, 'stage')} on " \
            f"{_n(s.num_devices, 'pipeline rank')} ({_n(plan.world, 'device')}), " \
            f"{_n(s.microbatches, 'micro-batch', 'micro-batches')}"
    names = row_names(result, lowered.groups)
    if args.json:
        from ssdsl.cli.jsonout import emit
        emit("show", {"plan": plan.name,
                   "world": plan.world, "world_assumed": assumed,
                   "params": {k: v if isinstance(v, (int, float, bool, str)) else str(v)
                              for k, v in plan.params},
                   "ranks": [list(g) for g in lowered.groups],
                   "makespan": result.makespan, "bubble_ratio": result.bubble_ratio,
                   "bubble_overhead": result.bubble_overhead,
                   "peak_activations": list(result.peak_activations),
                   "programs": [str(p) for p in s.programs]})
    else:
        console = Console(highlight=False, soft_wrap=True)
        if assumed:
            console.print(f"world = {plan.world} (assumed: give --world N for the number of "
                          "devices)", style="yellow")
        console.print(title, style="bold")
        console.print(timeline_text(result, names=names))
    if not args.no_picture:
        out = Path(args.output) if args.output else fresh_name(plan.name)
        _write_picture(timeline_svg(result, title=title, names=names), out)
        if not args.json:
            print(f"wrote {out}")
    return 0
