"""``ssdsl trace MODEL``: the operator table of a model file's training forward."""

from __future__ import annotations

import argparse

from ssdsl.cli import positive_int

# torch (through ssdsl.trace) is imported when the command runs, not when the parser is built:
# `ssdsl --help`, `--version` and a mistyped flag answer without loading it.


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="trace a model file and print its operator table",
                              description="Trace MODEL's forward and loss with torch.export (on "
                              "the meta device: nothing is allocated) and list its operators.")
    p.add_argument("model", help="model file (see docs/model_file.md)")
    p.add_argument("--json", action="store_true", help='print JSON (docs/json.md) instead of a table')
    p.add_argument("--device", default="meta", choices=("meta", "cpu"),
                   help="device to build the model on (default: meta)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="batch size (default: the "
                   "model file's BATCH_SIZE)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.trace.table import op_rows

    graph = trace(load_model_file(args.model), device=args.device, batch_size=args.batch_size)
    rows = op_rows(graph)
    if args.json:
        params = [{"name": q, "shape": list(graph.tensors[t].shape)}
                  for t, q in graph.params.items()]
        from ssdsl.cli.jsonout import emit
        emit("trace", {"model": args.model, "ops": rows, "weights": params,
                       "inputs": list(graph.inputs), "output": graph.output})
        return 0
    _print_table(rows, args.model, len(graph.params))
    return 0


def _print_table(rows: list[dict], model: str, n_params: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from ssdsl.trace.table import shape_text, splittable_text

    table = Table(title=f"{model}: {len(rows)} operators, {n_params} parameters",
                  title_justify="left")
    for col in ("name", "kind", "module", "shape", "splittable dims"):
        table.add_column(col, overflow="fold")
    for row in rows:
        dims = splittable_text(row)
        style = "yellow" if not row["annotated"] else None
        table.add_row(row["name"], row["kind"], row["module"] or "-", shape_text(row), dims,
                      style=style)
    Console(width=max(120, Console().width)).print(table)
    unannotated = sum(not r["annotated"] for r in rows)
    if unannotated:
        print(f"{unannotated} operator(s) can only be replicated (reasons above).")
