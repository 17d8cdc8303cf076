"""Time tracing GPT-3 175B (96 layers, hidden 12288, 96 heads, sequence 2048) on the meta device.

Run: ``.venv/bin/python bench/bench_trace.py [--layers 96] [--json]``. Reports the seconds spent
building the model on meta, in torch.export, converting to the IR with flowing names, and
annotating every op, plus the parameter count (nothing is allocated).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from ssdsl.ops import NotAnnotated, annotate
from ssdsl.trace.export import _TrainingForward, graph_from_export, _input_seeds
from ssdsl.trace.model_file import ModelFile, default_loss, default_optimizer

ROOT = Path(__file__).resolve().parent.parent


def _gpt_module():
    spec = importlib.util.spec_from_file_location("ssdsl_bench_gpt", ROOT / "examples" / "gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--hidden", type=int, default=12288)
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    gpt = _gpt_module()
    times = {}

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = gpt.build_gpt(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden,
                              block_size=a.seq, vocab=a.vocab)
    times["build_meta_s"] = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())

    idx = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device="meta")
    batch = (idx[:, :-1], idx[:, 1:])
    t0 = time.perf_counter()
    ep = torch.export.export(_TrainingForward(model, default_loss), batch, strict=False)
    times["export_s"] = time.perf_counter() - t0

    mf = ModelFile(path="gpt3-175b", build_model=lambda: model, get_batch_fn=lambda s, b: batch,
                   loss=default_loss, make_optimizer=default_optimizer, batch_size=a.batch,
                   input_dims=(("batch", "seq"),), has_optimizer=False)
    t0 = time.perf_counter()
    graph = graph_from_export(ep, seeds=_input_seeds(mf, ep, 1), model=model)
    times["to_ir_with_names_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    missing = sum(isinstance(annotate(graph, op), NotAnnotated) for op in graph.ops)
    times["annotate_all_s"] = time.perf_counter() - t0
    times["total_s"] = sum(times.values())
    result = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq,
              "params": n_params, "ops": len(graph.ops), "unannotated": missing,
              **{k: round(v, 2) for k, v in times.items()}}
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>20}: {v:,}" if isinstance(v, int) else f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
