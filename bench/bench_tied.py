"""Communication per step of a pipelined GPT whose LM head is tied to its token embedding, with
and without computing batch-free values on each stage that reads them
(``ssdsl.materialize.copies``): planned on ``meta``, nothing runs; bytes are the plan's own
accounting (``Materialized.accounting``: every edge's adapter per micro-batch, forward and
backward, plus the gradient reducer once per step).

    python bench/bench_tied.py [--layers 12 --hidden 768 --heads 12 --seq 1024 --vocab 50257]
                               [--batch 16] [--microbatches 8] [--plan 1f1b:2 ...]

``--plan NAME:WORLD[:k=v,...]`` (repeatable) is a stdlib plan, its world and its ``--set``s;
the default is 1f1b on 2 and 4 stages and dp 2 x pp 2. Prints JSON, one row per plan: MB per step
with the rule off and on, split into forward, backward and gradients.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_plan import meta_gpt_graph
from ssdsl.elaborate import elaborate_file
from ssdsl.materialize import copies
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan

DEFAULT_PLANS = ("1f1b:2", "1f1b:4", "dp_tp_1f1b:4:dp=2,pp=2")


def _mb(table: dict, section: str) -> float:
    return round(sum(v["bytes"] for v in table[section].values()) / 1e6, 1)


def measure(graph, spec: str, microbatches: int) -> dict:
    name, world, *rest = spec.split(":")
    sets = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest else {}
    sets.setdefault("microbatches", str(microbatches))
    plan = elaborate_file(name, world=int(world), sets=sets)
    t, lowered = schedule_plan(graph, plan)
    row: dict = {"plan": spec, "microbatches": int(sets["microbatches"])}
    for label, enabled in (("off", False), ("on", True)):
        old = copies.ENABLED
        copies.ENABLED = enabled
        try:
            table = materialize(t, dtype=torch.float32, schedule=lowered).accounting()
        finally:
            copies.ENABLED = old
        row[label] = {s: _mb(table, s) for s in ("forward", "backward", "gradients")}
        row[label]["total"] = round(table["total_bytes"] / 1e6, 1)
    row["saved_mb"] = round(row["off"]["total"] - row["on"]["total"], 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--plan", action="append", default=None, metavar="NAME:WORLD[:k=v,...]")
    a = p.parse_args()
    graph = meta_gpt_graph(a.layers, a.heads, a.hidden, a.seq, a.vocab, a.batch)
    table = graph.tensors[next(op for op in graph.ops if op.name.startswith("share_")).outputs[0]]
    rows = [measure(graph, spec, a.microbatches) for spec in a.plan or DEFAULT_PLANS]
    print(json.dumps({"model": f"gpt {a.layers}x{a.hidden}, seq {a.seq}, vocab {a.vocab}, "
                               f"batch {a.batch}",
                      "tied_table_mb": round(table.numel * 4 / 1e6, 1), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
