"""``ssdsl compile MODEL PLAN -o DIR``: write the per-rank programs as readable Python files.

The model is traced on the meta device (nothing is allocated), the plan applied, placed,
materialized, lowered to one program per rank and checked (``ssdsl.check.check_programs``);
then ``DIR/rank<N>.py`` (``ssdsl.codegen``) and ``DIR/rank<N>.program`` (the program's text
form, ``ssdsl.lower.program_text``) are written for every rank. A folder holding files that
ssdsl did not generate is refused. ``ssdsl run MODEL PLAN --compiled DIR`` runs the files.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from typing import Any

from ssdsl.cli.check import add_plan_options, elaborate_from_args


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("compile", help="write readable per-rank Python programs",
                              description="Apply PLAN to MODEL and write one Python module per "
                              "rank (DIR/rank0.py, ...), each statement annotated with the plan "
                              "line that caused it, and each rank's lowered program "
                              "(DIR/rank0.program, ...).")
    p.add_argument("model", help="the model file (.py)")
    p.add_argument("plan", help="a .ssp file or a stdlib plan name")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder to write into (created when missing)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes that write the files (default: the cores this process may "
                   "use); the files do not depend on it")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
                   help="the dtype `ssdsl run --compiled` will train in (default: float32); "
                   "casts in the forward (.to(x.dtype)) are written in it")
    add_plan_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ssdsl.cli._resolve import _resolve, lower_and_check
    from ssdsl.codegen import (Provenance, default_jobs, generate_rank, rank_order,
                                write_programs)
    from ssdsl.gcpause import gc_paused
    from ssdsl.materialize.program import materialize
    from ssdsl.runtime.job import DTYPES, compiled_graph
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(args.model)
    plan = elaborate_from_args(args.plan, args)
    with gc_paused(keep=True):  # one plan per process: what planning makes lives to the end
        dtype = DTYPES[args.dtype]
        t, lowered = _resolve(compiled_graph(mf, dtype), plan)
        m = materialize(t, dtype=dtype, schedule=lowered)
        programs = lower_and_check(m)
    prov = Provenance.of(args.model, plan)
    texts: dict[str, Any] = {}  # each made as it is written: one module held at a time
    for p in programs:
        texts[f"rank{p.rank}.py"] = functools.partial(generate_rank, m, p.rank, prov, p)
        texts[f"rank{p.rank}.program"] = functools.partial(_program_file, p)
    with gc_paused(keep=True):  # the modules' shared lines live to the end as well
        paths = write_programs(args.output, texts, jobs=args.jobs or default_jobs(),
                               order=rank_order(m))
    for path in paths:
        if path.suffix == ".py":
            p = programs[int(path.stem.removeprefix("rank"))]
            # a loss sum over this rank alone talks to no one (every rank holds the whole loss)
            kinds = collections.Counter(i.kind for i in p.instructions
                                        if not (i.kind == "loss_sum" and len(i.group) < 2))
            talks = [(kinds[k], what) for k, what in _COMMUNICATION if kinds[k]]
            detail = f": {', '.join(_counted(n, what) for n, what in talks)}" if talks else ""
            print(f"wrote {path}  ({sum(n for n, _ in talks)} communication steps{detail}; "
                  f"{kinds['call']} local calls; {len(p)} instructions)", file=sys.stdout)
    return 0


# The instructions that talk to other ranks, as the summary line names them.
_COMMUNICATION = (("comm", "adapter step"), ("reduce", "gradient bucket"),
                  ("gather", "weight gather after the step"),
                  ("gather_params", "ZeRO-3 parameter gather"), ("loss_sum", "loss sum"))


def _counted(n: int, what: str) -> str:
    head, _, tail = what.partition(" after")
    return f"{n} {head}{'s' if n != 1 else ''}{' after' + tail if tail else ''}"


def _program_file(p) -> str:
    from ssdsl.codegen import GENERATED_MARK
    from ssdsl.lower import program_text
    return (f"{GENERATED_MARK}; the lowered program of rank {p.rank} "
            "(ssdsl.lower.parse_program reads it)\n" + program_text(_base_names(p)))


def _base_names(p):
    """``p`` with plan files named by their base names (the text stays path-free)."""
    import attrs
    from pathlib import Path

    def short(ins):
        span = getattr(ins, "span", None)
        if span is None:
            return ins
        return attrs.evolve(ins, span=attrs.evolve(span, file=Path(span.file).name))
    return attrs.evolve(p, instructions=tuple(short(i) for i in p.instructions))
