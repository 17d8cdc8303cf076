"""Step time of zero-bubble pipelines: ssdsl ``zb_h1`` and ``zb_v`` against ssdsl ``1f1b``, and
torch's zero-bubble schedules against torch's 1F1B, on the same gloo ranks and model, in one run.

    .venv/bin/python bench/bench_zb.py [--nproc 2] [--layers 4] [--width 128]
                                       [--microbatches 4] [--batch-size 16] [--steps 8]
                                       [--warmup 2] [--runs 3]

The model, stages, ranks and optimizer are ``bench_pipeline.py``'s (its GPT with the LM head
untied; ``--nproc`` stages of ``layers / nproc`` blocks). The runs: ssdsl's 1F1B, ZB-H1 and ZB-V
plans (``stdlib_plans/zb_h1.ssp`` and ``zb_v.ssp`` with the benchmark's stage selectors; ZB-V's
2 * nproc virtual stages of ``layers / (2 nproc)`` blocks, in a V) and
``torch.distributed.pipelining``'s ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with one
stage per rank (its ZB1P schedule) and ``ScheduleZBVZeroBubble`` on the same V. A step's time is
the slowest rank's; a run's is the median after ``--warmup``; the figure is the median over
``--runs`` launches, all launched in turn in each round so that the machine's load falls on all
of them alike. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import MODEL, _run_time, _Stage, add_run_args, plan_text  # noqa: E402

from ssdsl.runtime.launch import launch  # noqa: E402


def stdlib_plan_text(name: str, nproc: int, layers: int, microbatches: int) -> str:
    """Stdlib plan ``name`` with the benchmark's stages: ``bench_pipeline.plan_text``'s
    selectors (one stage per rank), or 2 * nproc of them for the V (``zb_v``)."""
    virtual = 2 * nproc if name == "zb_v" else nproc
    k = layers // virtual
    selectors = ", ".join(f"h.{s * k}" for s in range(virtual))
    text = (ROOT / "stdlib_plans" / f"{name}.ssp").read_text()
    old = "stages into 2 * stages as vs" if name == "zb_v" else "stages into stages as st"
    assert old in text and "microbatches: int = 2 * stages" in text
    return (text.replace(old, f"stages {selectors} as {old.split()[-1]}")
            .replace("microbatches: int = 2 * stages", f"microbatches: int = {microbatches}"))


def torch_worker(model_path: str, nproc: int, layers: int, microbatches: int, steps: int,
                 schedule_name: str) -> list[float]:
    """One rank of a torch.distributed.pipelining run with schedule ``schedule_name``."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = mf.build(seed=0)
        r = ctx.rank
        cls = getattr(pipelining, schedule_name)
        v = cls is pipelining.ScheduleZBVZeroBubble  # two stages per rank, in a V
        n = 2 * nproc if v else nproc
        k = layers // n
        mine = [r, n - 1 - r] if v else [r]
        subs = [_Stage(model, s * k, (s + 1) * k, s == 0, s == n - 1) for s in mine]
        stages = [pipelining.PipelineStage(sub, s, n, torch.device("cpu"))
                  for sub, s in zip(subs, mine)]

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     target.reshape(-1))

        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        schedule = cls(stages if multi else stages[0], microbatches, loss_fn=loss_fn)
        # bench_pipeline's _Stage keeps the whole model as a submodule: its parameters are
        # every stage's, so take each once
        params = {id(q): q for sub in subs for q in sub.parameters()}
        opt = torch.optim.SGD(list(params.values()), lr=0.01)
        first, last = 0 in mine, n - 1 in mine
        times = []
        for step in range(steps):
            (x,), y = mf.get_batch(step, mf.batch_size)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            if first and last:
                schedule.step(x, target=y, losses=[])
            elif first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            times.append(time.perf_counter() - start)
        return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    if args.layers % (2 * args.nproc):
        p.error("--layers must be a multiple of 2 * --nproc (ZB-V's virtual stages)")
    figures: dict[str, list[float]] = {}
    errors: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "bench_gpt.py"
        model.write_text(MODEL.format(gpt=str(ROOT / "examples" / "gpt.py"), layers=args.layers,
                                      width=args.width, heads=args.heads, seq=args.seq,
                                      vocab=args.vocab, batch=args.batch_size))
        plans = {"ssdsl_1f1b": plan_text(args.nproc, args.layers, args.microbatches)}
        for name in ("zb_h1", "zb_v"):
            plans[f"ssdsl_{name}"] = stdlib_plan_text(name, args.nproc, args.layers,
                                                      args.microbatches)
        runs = {}
        for name, text in plans.items():
            f = Path(tmp) / f"{name}.ssp"
            f.write_text(text)
            runs[name] = ("bench_pipeline:ssdsl_worker", (str(model), str(f), args.steps))
        for name, cls in (("torch_1f1b", "Schedule1F1B"),
                          ("torch_zero_bubble", "ScheduleInterleavedZeroBubble"),
                          ("torch_zbv", "ScheduleZBVZeroBubble")):
            runs[name] = ("bench_zb:torch_worker", (str(model), args.nproc, args.layers,
                                                    args.microbatches, args.steps, cls))
        for _ in range(args.runs):
            for name, (worker, wargs) in runs.items():
                try:
                    per_rank = launch(worker, nproc=args.nproc, args=wargs, timeout_s=600)
                except Exception as err:  # noqa: BLE001 - a schedule that does not run on gloo
                    # kept and reported; the other rounds still run it (a failure may be a flake)
                    errors.setdefault(name, []).append(f"{type(err).__name__}: {err}"[:2000])
                    continue
                figures.setdefault(name, []).append(_run_time(per_rank, args.warmup))
    step_s = {k: statistics.median(v) for k, v in figures.items()}
    pairs = [("ssdsl_zb_h1", "ssdsl_1f1b"), ("ssdsl_zb_v", "ssdsl_1f1b"),
             ("torch_zero_bubble", "torch_1f1b"), ("torch_zbv", "torch_1f1b"),
             ("ssdsl_1f1b", "torch_1f1b"), ("ssdsl_zb_h1", "torch_zero_bubble"),
             ("ssdsl_zb_v", "torch_zbv")]
    ratios = {f"{a} / {b}": step_s[a] / step_s[b] for a, b in pairs
              if a in step_s and b in step_s}
    result = {"config": vars(args), "machine": f"{platform.machine()}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}",
              "step_s": step_s, "ratios": ratios, "runs": figures, "errors": errors}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
