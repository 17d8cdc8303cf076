"""``ssdsl compile MODEL PLAN -o DIR``: write the per-rank programs as readable Python files.

The model is traced on the meta device (nothing is allocated), the plan applied and materialized,
and ``DIR/rank<N>.py`` written for every rank (``ssdsl.codegen``). A folder holding files that
ssdsl did not generate is refused.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ssdsl.cli.check import add_plan_options, elaborate_from_args


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("compile", help="write readable per-rank Python programs",
                              description="Apply PLAN to MODEL and write one Python module per "
                              "rank (DIR/rank0.py, ...), each statement annotated with the plan "
                              "line that caused it.")
    p.add_argument("model", help="the model file (.py)")
    p.add_argument("plan", help="a .ssp file or a stdlib plan name")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder to write into (created when missing)")
    add_plan_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ssdsl.codegen import Provenance, generate_all, write_programs
    from ssdsl.materialize.program import materialize
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.transform import transform

    mf = load_model_file(args.model)
    plan = elaborate_from_args(args.plan, args)
    m = materialize(transform(trace(mf, device="meta"), plan))
    texts = generate_all(m, Provenance.of(args.model, plan))
    for path in write_programs(args.output, texts):
        text = texts[path.name]
        print(f"wrote {path}  ({_count(text, 'rt.adapter(')} adapters, "
              f"{_count(text, '= aten.') + _count(text, '= torch.ops.')} local calls)",
              file=sys.stdout)
    return 0


def _count(text: str, what: str) -> int:
    return text.count(what)
