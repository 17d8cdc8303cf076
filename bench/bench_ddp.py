"""Step time of torch DistributedDataParallel on gloo: the baseline an ssdsl ``dp`` plan is held to.

    .venv/bin/python bench/bench_ddp.py [--model examples/mlp.py] [--nproc 2] [--batch-size 32]
                                        [--steps 12] [--warmup 3] [--runs 5]

Each *run* is a fresh launch of ``--nproc`` ranks (``ssdsl.runtime.launch``) that trains
``--steps`` steps on the global batch ``--batch-size`` (each rank takes its contiguous share, as a
data-parallel plan does). A step's time is the slowest rank's; a run's time is the median over the
steps after ``--warmup``; the figure reported is the median over ``--runs`` runs, which go
round-robin over the measurements. Prints JSON.

Measurements are kept in ``MEASUREMENTS`` (name -> function returning one run's per-step times), so
the ssdsl ``dp`` measurement is added beside ``ddp`` with the same model, ranks, batch and statistics.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch

from ssdsl.runtime.launch import launch

Measurement = Callable[..., list[float]]

# Used when no model file is given and examples/mlp.py does not exist yet.
_FALLBACK_MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    BATCH_SIZE = 32
    WIDTH = 512

    def build_model():
        return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                             nn.GELU(), nn.Linear(WIDTH, 10))

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(batch_size, WIDTH, generator=g),
                torch.randint(0, 10, (batch_size,), generator=g))
''')


_KEPT: list = []  # what a rank built, kept until it leaves (``bench_peers._KEPT``)


def ddp_worker(model_path: str, batch_size: int, steps: int, seed: int) -> list[float]:
    """One rank of a DDP run: the time of every step on this rank, in seconds."""
    from torch.nn.parallel import DistributedDataParallel

    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.train import MetricsCollector, OptimizerSpec, build_optimizer
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = DistributedDataParallel(mf.build(seed=seed).to(ctx.device))
        _KEPT.append(model)  # freed after the group's teardown, its destructor can hang the rank
        opt = build_optimizer(OptimizerSpec("model"), mf, model.parameters())
        share = batch_size // ctx.world_size
        rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
        metrics = MetricsCollector(rank=ctx.rank, samples_per_step=batch_size, device=ctx.device)
        for step in range(steps):
            inputs, target = mf.get_batch(step, batch_size)
            inputs = tuple(t[rows].to(ctx.device) for t in inputs)
            target = target[rows].to(ctx.device)
            torch.distributed.barrier()  # start every rank's clock together
            metrics.begin()
            opt.zero_grad(set_to_none=True)
            loss = mf.loss(model(*inputs), target)
            loss.backward()  # DDP all-reduces gradient buckets during backward
            opt.step()
            metrics.end(step, loss=None)
        return [m.step_s for m in metrics.history]


def _measure(worker: str) -> Measurement:
    """A measurement that launches ``worker``; per step, the slowest rank's time."""
    def measure(model_path: str, *, nproc: int, batch_size: int, steps: int, seed: int
                ) -> list[float]:
        per_rank = launch(f"bench_ddp:{worker}", nproc=nproc,
                          args=(model_path, batch_size, steps, seed), timeout_s=600)
        return [max(times) for times in zip(*per_rank)]
    return measure


def ssdsl_worker(model_path: str, batch_size: int, steps: int, seed: int) -> list[float]:
    """One rank of an ssdsl ``dp`` run, through the same pieces as ``ssdsl run``.

    The global batch is fetched before the clock starts, as the DDP loop fetches it; the
    timed step includes what the executor does with it (each rank narrows it to its rows).
    """
    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.executor import RankProgram, create_groups
    from ssdsl.runtime.job import JobSpec, plan_job
    from ssdsl.runtime.train import MetricsCollector, OptimizerSpec

    spec = JobSpec(model_path, "dp", batch_size=batch_size, seed=seed)
    with distributed() as ctx:
        mf, m, model = plan_job(spec, ctx.world_size)
        prog = RankProgram(m, ctx.rank, mf, model, dtype=torch.float32,
                           optimizer=OptimizerSpec("model"), groups=create_groups(m))
        metrics = MetricsCollector(rank=ctx.rank, samples_per_step=batch_size, device=ctx.device)
        for step in range(steps):
            inputs, target = mf.get_batch(step, batch_size)
            torch.distributed.barrier()
            metrics.begin()
            prog.train_batch((*inputs, target))
            metrics.end(step, loss=None)
        return [m.step_s for m in metrics.history]


MEASUREMENTS: dict[str, Measurement] = {"ddp": _measure("ddp_worker"),
                                        "ssdsl_dp": _measure("ssdsl_worker")}


def run_benchmark(model_path: str, *, names: list[str], nproc: int, batch_size: int, steps: int,
                  warmup: int, runs: int, seed: int = 0) -> dict:
    """Every measurement in ``names``, ``runs`` times each, round-robin (a change in the
    machine's load hits every measurement alike); medians and the raw run figures."""
    results = {}
    medians: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(runs):
        for name in names:
            step_times = MEASUREMENTS[name](model_path, nproc=nproc, batch_size=batch_size,
                                            steps=steps, seed=seed)
            medians[name].append(statistics.median(step_times[warmup:]))
    for name, run_medians in medians.items():
        median = statistics.median(run_medians)
        results[name] = {"median_step_s": median, "samples_per_s": batch_size / median,
                         "run_median_step_s": run_medians}
    if {"ddp", "ssdsl_dp"} <= results.keys():
        results["ratio_ssdsl_over_ddp"] = (results["ssdsl_dp"]["median_step_s"]
                                           / results["ddp"]["median_step_s"])
    return {"model": model_path, "nproc": nproc, "batch_size": batch_size, "steps": steps,
            "warmup": warmup, "runs": runs, "backend": "gloo", "torch": torch.__version__,
            "machine": platform.machine(), "results": results}


def _default_model(tmp: Path) -> str:
    example = Path(__file__).resolve().parent.parent / "examples" / "mlp.py"
    if example.is_file():
        return str(example)
    path = tmp / "bench_mlp.py"
    path.write_text(_FALLBACK_MODEL)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model file (default: examples/mlp.py or a built-in MLP)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", nargs="*", choices=sorted(MEASUREMENTS),
                        default=sorted(MEASUREMENTS))
    args = parser.parse_args(argv)
    if args.batch_size % args.nproc:
        parser.error("--batch-size must be a multiple of --nproc")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _default_model(Path(tmp))
        report = run_benchmark(model, names=args.only, nproc=args.nproc,
                               batch_size=args.batch_size, steps=args.steps,
                               warmup=args.warmup, runs=args.runs)
    if args.model is None and "bench_mlp.py" in model:
        report["model"] = "built-in MLP (512-2048-512-10)"
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
