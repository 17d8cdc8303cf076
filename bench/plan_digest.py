"""A digest of everything planning produces, to show that a speed-up changed no output.

For a few small plans on a GPT traced on ``meta`` (dp_tp_1f1b at 16 and 64 ranks among them), it
hashes the transformed parts, the schedule, every rank's lowered program (text form) and every
generated per-rank file, and prints one line per plan plus a digest of all of them:

    .venv/bin/python bench/plan_digest.py > before.txt   # ... change the planner ...
    .venv/bin/python bench/plan_digest.py | diff before.txt -
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from bench_plan import meta_gpt_graph
from ssdsl.elaborate import elaborate_file
from ssdsl.errors import SsdslError
from ssdsl.runtime.job import schedule_plan

# (name, layers, heads, batch, plan, world, sets)
CASES = (
    ("dp_tp_1f1b-16", 4, 4, 16, "dp_tp_1f1b", 16, {"dp": "2", "tp": "2", "pp": "4",
                                                    "microbatches": "8"}),
    ("dp_tp_1f1b-64", 8, 4, 16, "dp_tp_1f1b", 64, {"dp": "2", "tp": "4", "pp": "8",
                                                    "microbatches": "8"}),
    ("dp_tp_1f1b-mb1", 4, 4, 8, "dp_tp_1f1b", 8, {"dp": "2", "tp": "2", "pp": "2",
                                                   "microbatches": "1"}),
    ("1f1b-4", 4, 4, 8, "1f1b", 4, {"microbatches": "8"}),
    ("gpipe-4", 4, 4, 8, "gpipe", 4, {}),
    ("zb_h1-4", 4, 4, 8, "zb_h1", 4, {}),
    ("zb_v-4", 4, 4, 8, "zb_v", 4, {}),
    ("interleaved-4", 8, 4, 8, "interleaved_1f1b", 4, {}),
    ("megatron_tp-4", 2, 4, 8, "megatron_tp", 4, {}),
    ("megatron_sp-4", 2, 4, 8, "megatron_sp", 4, {}),
    ("dp-4", 2, 4, 8, "dp", 4, {}),
    ("dp_tp-8", 2, 4, 8, "dp_tp", 8, {"dp": "2", "tp": "4"}),
    ("dp_zero-4", 2, 4, 8, "dp_zero", 4, {}),
    ("coshard-4", 2, 8, 8, "coshard", 4, {}),
)


def graph_of(layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int):
    """A GPT traced on ``meta`` (as bench_plan traces it)."""
    return meta_gpt_graph(layers, heads, hidden, seq, vocab, batch)


def digests(graph, plan_name: str, world: int, sets: dict[str, str]) -> dict[str, str]:
    """Digests of each thing planning produces (an error's message where it refuses)."""
    from ssdsl.codegen.emit import Provenance, generate_rank
    from ssdsl.lower import lower_rank
    from ssdsl.lower.text import program_text
    from ssdsl.materialize.program import materialize

    out: dict[str, str] = {}
    plan = elaborate_file(plan_name, world=world, sets=sets)
    try:
        t, lowered = schedule_plan(graph, plan)
    except SsdslError as err:
        return {"error": err.message}
    out["parts"] = _h(repr(sorted((op, repr(ps)) for op, ps in t.parts.items())))
    out["transformed"] = _h(repr((t.microbatches, sorted(t.shapes.items()),
                                  sorted(t.input_boxes.items()), t.boxes)))
    out["schedule"] = _h(repr(lowered.schedule) if lowered is not None else "-")
    m = materialize(t, dtype=torch.float32, schedule=lowered)
    prov = Provenance.of("gpt.py", plan)
    programs, files = [], []
    for r in range(world):
        p = lower_rank(m, r)
        programs.append(program_text(p))
        try:
            files.append(generate_rank(m, r, prov, p))
        except SsdslError as err:
            files.append(f"error: {err.message}")
    out["programs"] = _h("\n\0".join(programs))
    out["files"] = _h("\n\0".join(files))
    return out


def _h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="one case name")
    a = p.parse_args()
    every = hashlib.sha256()
    for name, layers, heads, batch, plan, world, sets in CASES:
        if a.only and name != a.only:
            continue
        graph = graph_of(layers, 64, heads, 16, batch, 128)
        line = f"{name}: " + " ".join(f"{k}={v}" for k, v in digests(graph, plan, world,
                                                                    sets).items())
        every.update(line.encode())
        print(line, flush=True)
    print("all:", every.hexdigest()[:16])


if __name__ == "__main__":
    main()
