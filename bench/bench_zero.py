"""Model state per rank and step time of ZeRO plans on gloo: dp, dp_zero stage 1 and 2, and
torch FSDP2 (``fully_shard``) beside them.

    PYTHONPATH=. .venv/bin/python bench/bench_zero.py [--model bench/gpt_small.py] [--nproc 2]
        [--batch-size 16] [--steps 6] [--warmup 2] [--only dp zero1 zero2 fsdp2]

Each measurement is a fresh launch of ``--nproc`` ranks (``ssdsl.runtime.launch``) that trains
``--steps`` steps with the model file's optimizer (AdamW for gpt_small.py: two moments per
element). Per rank, after each step, it reads the bytes of parameters, gradients and optimizer
state the rank holds (``ssdsl.runtime.zero.model_state_bytes``; for FSDP2 the local shards of
its DTensors) and the process's peak RSS; a step's time is the slowest rank's, the figure is the
median after ``--warmup``. Prints JSON; ``ratio_*`` are rank 0's model-state bytes over dp's and
the step time over FSDP2's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from ssdsl.runtime.launch import launch

ROOT = Path(__file__).resolve().parent.parent
PLANS = {"dp": ("dp", ()), "zero1": ("dp_zero", (("stage", "1"),)),
         "zero2": ("dp_zero", (("stage", "2"),))}


def ssdsl_worker(spec, batch_size: int, steps: int) -> dict:
    """One rank of an ssdsl run of ``spec`` (planned by the launcher, as ``ssdsl run`` does):
    step times, model-state bytes, peak RSS."""
    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.executor import RankProgram, create_groups
    from ssdsl.runtime.job import plan_with_state
    from ssdsl.runtime.train import MetricsCollector, OptimizerSpec

    with distributed() as ctx:
        mf, m, init = plan_with_state(spec, ctx)
        prog = RankProgram(m, ctx.rank, mf, init, dtype=torch.float32,
                           optimizer=OptimizerSpec("model"), groups=create_groups(m))
        metrics = MetricsCollector(rank=ctx.rank, samples_per_step=batch_size, device=ctx.device)
        held = []
        for step in range(steps):
            torch.distributed.barrier()
            metrics.begin()
            prog.step(step, batch_size)
            metrics.end(step, loss=None)
            held.append(prog.model_state_bytes())
        return {"step_s": [x.step_s for x in metrics.history], "state": held[-1],
                "peak_rss": metrics.history[-1].peak_memory_bytes}


def fsdp2_worker(model_path: str, batch_size: int, steps: int) -> dict:
    """One rank of torch FSDP2: every block and the root ``fully_shard``-ed over all ranks."""
    from torch.distributed.fsdp import fully_shard

    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.train import MetricsCollector, OptimizerSpec, build_optimizer
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = mf.build(seed=0)
        for module in model.modules():  # one unit per transformer block, as FSDP is used
            if type(module).__name__ == "Block":
                fully_shard(module)
        fully_shard(model)
        opt = build_optimizer(OptimizerSpec("model"), mf, model.parameters())
        share = batch_size // ctx.world_size
        rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
        metrics = MetricsCollector(rank=ctx.rank, samples_per_step=batch_size, device=ctx.device)
        held = []
        for step in range(steps):
            inputs, target = mf.get_batch(step, batch_size)
            inputs, target = tuple(t[rows] for t in inputs), target[rows]
            torch.distributed.barrier()
            metrics.begin()
            opt.zero_grad(set_to_none=True)
            mf.loss(model(*inputs), target).backward()
            opt.step()
            metrics.end(step, loss=None)
            held.append(_fsdp_state_bytes(model, opt))
        return {"step_s": [x.step_s for x in metrics.history], "state": held[-1],
                "peak_rss": metrics.history[-1].peak_memory_bytes}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_state_bytes(model, opt) -> dict[str, int]:
    def nbytes(t) -> int:
        return 0 if t is None else _local(t).numel() * _local(t).element_size()
    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters())
    state = sum(nbytes(v) for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": state,
            "total": params + grads + state}


def measure(name: str, model_path: str, *, nproc: int, batch_size: int, steps: int,
            warmup: int) -> dict:
    from ssdsl.runtime.job import JobSpec, launch_files
    if name == "fsdp2":
        per_rank = launch("bench_zero:fsdp2_worker", nproc=nproc,
                          args=(model_path, batch_size, steps), timeout_s=900)
    else:
        plan, sets = PLANS[name]
        with launch_files(JobSpec(model_path, plan, sets=sets, batch_size=batch_size),
                          nproc) as planned:
            per_rank = launch("bench_zero:ssdsl_worker", nproc=nproc,
                              args=(planned.spec, batch_size, steps), timeout_s=900)
    step_s = [max(times) for times in zip(*(r["step_s"] for r in per_rank))]
    return {"median_step_s": statistics.median(step_s[warmup:]),
            "state_bytes_per_rank": [r["state"] for r in per_rank],
            "peak_rss_per_rank": [r["peak_rss"] for r in per_rank]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "bench" / "gpt_small.py"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=["dp", "zero1", "zero2", "fsdp2"],
                        choices=["dp", "zero1", "zero2", "fsdp2"])
    args = parser.parse_args(argv)
    if args.batch_size % args.nproc:
        parser.error("--batch-size must be a multiple of --nproc")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks import bench_zero
    results = {name: measure(name, args.model, nproc=args.nproc, batch_size=args.batch_size,
                             steps=args.steps, warmup=args.warmup) for name in args.only}
    if "dp" in results:
        dp = results["dp"]["state_bytes_per_rank"][0]["total"]
        for name, r in results.items():
            r["ratio_state_over_dp"] = r["state_bytes_per_rank"][0]["total"] / dp
    if "fsdp2" in results:
        f = results["fsdp2"]["median_step_s"]
        for name, r in results.items():
            r["ratio_step_over_fsdp2"] = r["median_step_s"] / f
    json.dump({"model": args.model, "nproc": args.nproc, "batch_size": args.batch_size,
               "steps": args.steps, "warmup": args.warmup, "backend": "gloo",
               "torch": torch.__version__, "machine": platform.machine(), "results": results},
              sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
