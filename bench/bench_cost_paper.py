"""Predicted step time, bubble and memory of paper-scale models under ssdsl's plans (no run).

    python bench/bench_cost_paper.py                       # all models, 32 x V100, float16
    python bench/bench_cost_paper.py --only swin --device a100
    python bench/bench_cost_paper.py --compare             # co-shard, 3F1B against baselines

Each model file under ``bench/paper/`` is traced once on the meta device; every plan is
applied, materialized and costed by ``ssdsl.cost`` (the same path as ``ssdsl cost``). A plan that
ssdsl refuses for a model is reported with its error's first line. Prints one JSON line per
(model, plan) and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ssdsl.cost import Cluster, CostOptions, estimate, profile
from ssdsl.elaborate import elaborate_file
from ssdsl.errors import SsdslError
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file

PAPER = Path(__file__).resolve().parent / "paper"
SWIN_NAMES = {"blocks": "stages.*.*", "attn_out": "attn.proj", "mlp_out": "mlp.2"}
EVO_NAMES = {"blocks": "blocks.*", "attn": "row_attn", "attn_out": "row_attn.out",
             "mlp": "msa_transition", "mlp_out": "msa_transition.fc2"}
MODELS = {"swin": SWIN_NAMES, "t5": {}, "gpt_vocab": {}, "evoformer": EVO_NAMES}


def plans(names: dict[str, str], world: int, batch: int) -> list[tuple[str, str, dict]]:
    """(label, stdlib plan, --set values) for the plans ssdsl has today."""
    tp = min(8, world)
    pp = world // tp
    mb = min(batch, 2 * world)
    dp_tp = str(PAPER / "dp_tp_named.ssp")
    dp_tp_1f1b = str(PAPER / "dp_tp_1f1b_named.ssp")
    return [
        ("dp", "dp", {}),
        (f"megatron_tp in dp_tp (dp={world // tp}, tp={tp})", dp_tp,
         {"dp": str(world // tp), "tp": str(tp), **names}),
        (f"1f1b ({world} stages, {mb} mb)", "1f1b", {"microbatches": str(mb)}),
        (f"gpipe ({world} stages, {mb} mb)", "gpipe", {"microbatches": str(mb)}),
        (f"interlaced_1f1b ({world} stages, {mb} mb)", "interlaced_1f1b",
         {"microbatches": str(mb)}),
        (f"dp_tp_1f1b (tp={tp}, pp={pp}, {min(batch, 4 * pp)} mb)", dp_tp_1f1b,
         {"dp": "1", "tp": str(tp), "pp": str(pp), "microbatches": str(min(batch, 4 * pp)),
          **names}),
    ]


def comparisons() -> list[tuple[str, int, int, str, str, dict]]:
    """The paper's plans next to the plans they are measured against: (model, world, batch,
    label, plan, --set values). Swin on one node of 8 (co-shard is tensor parallelism cut finer,
    so it is compared with Megatron at the same tp; data parallelism across nodes adds the same
    gradient all-reduce to both); the recycling Evoformer on a 4-stage pipeline."""
    recompute = str(PAPER / "megatron_recompute.ssp")
    gpipe_recycle = str(PAPER / "gpipe_recycle.ssp")
    out = []
    for batch in (1, 2, 3):
        out += [("swin", 8, batch, "megatron_tp (tp=8)", "megatron_tp", dict(SWIN_NAMES)),
                ("swin", 8, batch, "megatron_tp + recompute of attention and MLP", recompute,
                 dict(SWIN_NAMES)),
                ("swin", 8, batch, "coshard (tp=8, colocate=2)", "coshard",
                 {"colocate": "2", **SWIN_NAMES})]
    # Megatron without recompute at the largest batch co-shard holds on one node: twice the
    # devices, over two nodes (colocate=4 would cut the 16 heads into 32 parts: refused)
    out.append(("swin", 16, 3, "megatron_tp (tp=16, two nodes)", "megatron_tp",
                dict(SWIN_NAMES)))
    for mb in (8, 16):
        out += [("evoformer_recycle", 4, 16, f"GPipe with recycling (4 stages, {mb} mb)",
                 gpipe_recycle, {"microbatches": str(mb)}),
                ("evoformer_recycle", 4, 16, f"3F1B, recycle_1f1b (4 stages, {mb} mb)",
                 "recycle_1f1b", {"microbatches": str(mb)})]
    return out


def _cost(graph, plan: str, world: int, sets: dict, opts: CostOptions, prof) -> dict:
    row: dict = {}
    try:
        t, lowered = schedule_plan(graph, elaborate_file(plan, world=world, sets=sets))
        r = estimate(materialize(t, schedule=lowered), opts)
        row.update(step_s=r.step_time, bubble=r.bubble, comm_s=r.communication,
                   peak_GB=r.peak_memory / 1e9, fits=r.peak_memory <= prof.memory)
    except SsdslError as err:
        row["error"] = str(err).splitlines()[0][:160]
    return row


def compare(a) -> None:
    prof = profile(a.device)
    rows, graphs = [], {}
    for name, world, batch, label, plan, sets in comparisons():
        if a.only and a.only != name:
            continue
        if (name, batch) not in graphs:
            t0 = time.perf_counter()
            mf = load_model_file(PAPER / f"{name}.py")
            graphs[(name, batch)] = trace(mf, device="meta", batch_size=batch)
            print(f"# {name} batch {batch}: traced in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        opts = CostOptions(profile=prof, cluster=Cluster(world, prof.per_node), dtype=a.dtype,
                           optimizer="adamw")
        t0 = time.perf_counter()
        row = {"model": name, "world": world, "batch": batch, "plan": label,
               **_cost(graphs[(name, batch)], plan, world, sets, opts, prof),
               "plan_s": time.perf_counter() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{prof.name}, {a.dtype}, AdamW\n")
    _table(rows, {"model": "model", "world": "devices", "batch": "batch", "plan": "plan"})


def _table(rows: list[dict], head: dict[str, str]) -> None:
    """Markdown: the ``head`` columns (row key: column title), then the estimate's."""
    print("| " + " | ".join([*head.values(), "step (s)", "bubble", "comm (s)",
                             "peak memory (GB)"]) + " |")
    print("| " + " | ".join(["---:" if k in ("world", "batch") else "---" for k in head]
                            + ["---:"] * 4) + " |")
    for r in rows:
        cells = " | ".join(str(r[k]) for k in head)
        if "error" in r:
            print(f"| {cells} | refused: {r['error']} | | | |")
            continue
        fit = "" if r["fits"] else " (over)"
        print(f"| {cells} | {r['step_s']:.3g} | {r['bubble']:.0%} | {r['comm_s']:.3g} | "
              f"{r['peak_GB']:.3g}{fit} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="v100")
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--only", default=None)
    p.add_argument("--plan", default=None, help="only plans whose label contains this")
    p.add_argument("--compare", action="store_true",
                   help="the paper's plans (co-shard, 3F1B) next to their baselines instead")
    a = p.parse_args()
    if a.compare:
        compare(a)
        return
    prof = profile(a.device)
    opts = CostOptions(profile=prof, cluster=Cluster(a.world, prof.per_node), dtype=a.dtype,
                       optimizer="adamw")
    rows = []
    for name, names in MODELS.items():
        if a.only and a.only != name:
            continue
        t0 = time.perf_counter()
        mf = load_model_file(PAPER / f"{name}.py")
        graph = trace(mf, device="meta")
        nparams = sum(graph.tensors[t].numel for t in graph.params)
        print(f"# {name}: {len(graph.ops)} ops, {nparams / 1e9:.2f}B parameters, traced in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        extra = [(f"interlaced_1f1b as bench/paper/interlaced_t5.ssp ({a.world // 2} + "
                  f"{a.world // 2} stages, {min(mf.batch_size, 2 * a.world)} mb)",
                  str(PAPER / "interlaced_t5.ssp"),
                  {"microbatches": str(min(mf.batch_size, 2 * a.world))})] if name == "t5" else []
        for label, plan, sets in plans(names, a.world, mf.batch_size) + extra:
            if a.plan and a.plan not in label:
                continue
            t0 = time.perf_counter()
            row = {"model": name, "plan": label, "params_B": nparams / 1e9}
            try:
                t, lowered = schedule_plan(graph, elaborate_file(plan, world=a.world, sets=sets))
                r = estimate(materialize(t, schedule=lowered), opts)
                row.update(step_s=r.step_time, bubble=r.bubble, comm_s=r.communication,
                           peak_GB=r.peak_memory / 1e9, fits=r.peak_memory <= prof.memory)
            except SsdslError as err:
                row["error"] = str(err).splitlines()[0][:160]
            row["plan_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{a.world} x {prof.name}, {a.dtype}, AdamW\n")
    _table(rows, {"model": "model", "plan": "plan"})


if __name__ == "__main__":
    main()
