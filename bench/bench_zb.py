"""Step time of zero-bubble pipelines: ssdsl ``zb_h1`` against ssdsl ``1f1b``, and torch's
zero-bubble schedule against torch's 1F1B, on the same gloo ranks and model, in one run.

    .venv/bin/python bench/bench_zb.py [--nproc 2] [--layers 4] [--width 128]
                                       [--microbatches 4] [--batch-size 16] [--steps 8]
                                       [--warmup 2] [--runs 3]

The model, stages, ranks and optimizer are ``bench_pipeline.py``'s (its GPT with the LM head
untied; ``--nproc`` stages of ``layers / nproc`` blocks). The four runs: ssdsl's 1F1B and ZB-H1
plans (the same stage selectors; ZB-H1 as ``stdlib_plans/zb_h1.ssp`` orders its units) and
``torch.distributed.pipelining``'s ``Schedule1F1B`` and ``ScheduleInterleavedZeroBubble`` with one
stage per rank (its ZB1P schedule; ``ScheduleZBVZeroBubble`` needs two stages per rank in a V,
another stage layout, so it is left out). A step's time is the slowest rank's; a run's is the
median after ``--warmup``; the figure is the median over ``--runs`` launches, the four launched
in turn in each round so that the machine's load falls on all of them alike. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import MODEL, _run_time, _Stage, plan_text  # noqa: E402

from ssdsl.runtime.launch import launch  # noqa: E402


def zb_plan_text(nproc: int, layers: int, microbatches: int) -> str:
    """``zb_h1.ssp``'s order on the benchmark's stage selectors (``bench_pipeline.plan_text``)."""
    k = layers // nproc
    selectors = ", ".join(f"h.{s * k}" for s in range(nproc))
    return textwrap.dedent(f'''
        plan bench_zb_h1(stages: int = {nproc}, microbatches: int = {microbatches})
        microbatch along batch into microbatches
        stages {selectors} as st
        for s in 0..stages:
            assign st[s] to device s
            let warm = min(stages - s - 1, microbatches)
            let delay = min(s, microbatches)
            order on device s: forward st[s] mb 0..warm
            for k in 0..microbatches:
                if k < microbatches - warm:
                    order on device s: forward st[s] mb warm + k, input_grad st[s] mb k
                else:
                    order on device s: input_grad st[s] mb k
                if k >= delay:
                    order on device s: weight_grad st[s] mb k - delay
            order on device s: weight_grad st[s] mb microbatches - delay..microbatches
        ''').lstrip()


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
        k, r = layers // nproc, ctx.rank
        sub = _Stage(model, r * k, (r + 1) * k, r == 0, r == nproc - 1)
        stage = pipelining.PipelineStage(sub, r, nproc, torch.device("cpu"))

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     target.reshape(-1))

        cls = getattr(pipelining, schedule_name)
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        schedule = cls([stage] if multi else stage, microbatches, loss_fn=loss_fn)
        opt = torch.optim.SGD(sub.parameters(), lr=0.01)
        times = []
        for step in range(steps):
            (x,), y = mf.get_batch(step, mf.batch_size)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            if r == 0:
                schedule.step(x)
            elif r == nproc - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            times.append(time.perf_counter() - start)
        return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    if args.layers % args.nproc:
        p.error("--layers must be a multiple of --nproc")
    figures: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "bench_gpt.py"
        model.write_text(MODEL.format(gpt=str(ROOT / "examples" / "gpt.py"), layers=args.layers,
                                      width=args.width, heads=args.heads, seq=args.seq,
                                      vocab=args.vocab, batch=args.batch_size))
        plans = {"ssdsl_1f1b": plan_text, "ssdsl_zb_h1": zb_plan_text}
        runs = {}
        for name, text in plans.items():
            f = Path(tmp) / f"{name}.ssp"
            f.write_text(text(args.nproc, args.layers, args.microbatches))
            runs[name] = ("bench_pipeline:ssdsl_worker", (str(model), str(f), args.steps))
        for name, cls in (("torch_1f1b", "Schedule1F1B"),
                          ("torch_zero_bubble", "ScheduleInterleavedZeroBubble")):
            runs[name] = ("bench_zb:torch_worker", (str(model), args.nproc, args.layers,
                                                    args.microbatches, args.steps, cls))
        for _ in range(args.runs):
            for name, (worker, wargs) in runs.items():
                if name in errors:
                    continue
                try:
                    per_rank = launch(worker, nproc=args.nproc, args=wargs, timeout_s=600)
                except Exception as err:  # noqa: BLE001 - a schedule that does not run on gloo
                    errors[name] = f"{type(err).__name__}: {err}"[:2000]
                    continue
                figures.setdefault(name, []).append(_run_time(per_rank, args.warmup))
    step_s = {k: statistics.median(v) for k, v in figures.items()}
    ratios = {}
    if {"ssdsl_zb_h1", "ssdsl_1f1b"} <= step_s.keys():
        ratios["ssdsl_zb_h1 / ssdsl_1f1b"] = step_s["ssdsl_zb_h1"] / step_s["ssdsl_1f1b"]
    if {"torch_zero_bubble", "torch_1f1b"} <= step_s.keys():
        ratios["torch_zero_bubble / torch_1f1b"] = (step_s["torch_zero_bubble"]
                                                   / step_s["torch_1f1b"])
    if {"ssdsl_zb_h1", "torch_zero_bubble"} <= step_s.keys():
        ratios["ssdsl_zb_h1 / torch_zero_bubble"] = (step_s["ssdsl_zb_h1"]
                                                    / step_s["torch_zero_bubble"])
    result = {"config": vars(args), "machine": f"{platform.machine()}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}",
              "step_s": step_s, "ratios": ratios, "runs": figures, "errors": errors}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
