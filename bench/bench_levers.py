"""The executor's runtime levers on a data-parallel step, measured on the same ranks, step by step.

    python bench/bench_levers.py [--nproc 2] [--steps 40] [--model PATH] [--plan dp]
                                 [--batch-size N] [--layers N] [--levers L ...]

``bench_peers.py --off LEVER`` launches every variant afresh, so the load that other jobs put on a
shared machine moves between the variants' launches (it moved the figures by 2x here). This
script instead builds every variant on the same ranks, in one launch: ssdsl with every lever on,
ssdsl with one lever off (each of ``--levers``, default the levers of ``bench_peers.LEVERS``
that act on data parallelism), and ``DistributedDataParallel`` (the reference of a ``dp`` plan;
beside a pipeline plan, a yardstick only); then it runs one step of each in turn (in an order
drawn anew every step), ``--steps`` times, so that neighbouring steps of two variants see the
same load. A step's time is the slowest rank's; each variant's figure is the median of its steps
(after 2 warm-up rounds); a variant with a lever off pays the few microseconds of setting it
around its steps. Default model: the peers' nanoGPT-style decoder (``bench_peers.MODEL``).
Prints JSON: each variant's median step and its ratio to DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peers import _KEPT, LEVERS, LR, MODEL  # noqa: E402
from ssdsl.runtime.launch import launch  # noqa: E402

DP_LEVERS = ("overlap", "prebuilt", "prologue", "flat")
WARMUP = 2


def _ssdsl(model_path: str, plan: str, off: tuple[str, ...], first_batch):
    """A ``ParallelModel`` with the levers ``off`` turned off while it is made and around each
    of its steps (some are read once, when the executor fixes its plans on the first step;
    others at every step: ``PREBUILD`` at each instruction's first visit, the prologue's)."""
    import importlib

    import ssdsl

    levers = [(importlib.import_module(LEVERS[lv][0]), LEVERS[lv][1], LEVERS[lv][2]) for lv in off]

    def with_off(fn, *args):
        saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in levers]
        for mod, attr, value in levers:
            setattr(mod, attr, value)
        try:
            return fn(*args)
        finally:
            for mod, attr, value in saved:
                setattr(mod, attr, value)

    pm = with_off(lambda: ssdsl.parallelize(model_path, plan, optimizer="sgd", lr=LR,
                                            verify=False))
    with_off(pm.train_step, *first_batch)
    if not levers:
        return pm.train_step
    return lambda inputs, target: with_off(pm.train_step, inputs, target)


def worker(model_path: str, plan: str, steps: int, levers: tuple[str, ...] = DP_LEVERS
           ) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ssdsl.runtime.dist import init_from_env
    from ssdsl.trace.model_file import load_model_file

    torch.set_num_threads(1)
    ctx = init_from_env()
    mf = load_model_file(model_path)
    first = mf.get_batch(0, mf.batch_size)
    variants = {"ssdsl": _ssdsl(model_path, plan, (), first)}
    for lever in levers:
        variants[f"ssdsl-no-{lever}"] = _ssdsl(model_path, plan, (lever,), first)
    ddp = DistributedDataParallel(mf.build(seed=0))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    # kept to the end of the process, as bench_peers keeps its peers (``bench_peers._KEPT``):
    # freed as the worker returned, after the group's teardown, DDP's reducer hung rank 0 for
    # good in 80-step runs here (the launcher named it)
    _KEPT.append((ddp, opt, variants))
    share = mf.batch_size // ctx.world_size
    rows = slice(ctx.rank * share, (ctx.rank + 1) * share)

    def ddp_step(inputs, target):
        opt.zero_grad(set_to_none=True)
        loss = mf.loss(ddp(*(x[rows] for x in inputs)), target[rows])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the global batch's loss, as ssdsl reports it
        return total
    variants["ddp"] = ddp_step
    times: dict[str, list[float]] = {k: [] for k in variants}
    for step in range(steps + WARMUP):
        inputs, target = mf.get_batch(step, mf.batch_size)
        # a new order every step, the same on every rank: a rotation of one fixed order would
        # let each variant always follow the same one (it measured the variant after DDP
        # 3-6% slower than the others, whichever it was)
        names = list(variants)
        random.Random(step).shuffle(names)
        for name in names:
            one = variants[name]
            dist.barrier()
            start = time.perf_counter()
            one(inputs, target)
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's step
            if step >= WARMUP:
                times[name].append(float(took))
    dist.destroy_process_group()
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default=None, help="a model file (default: the peers' GPT)")
    p.add_argument("--plan", default="dp")
    p.add_argument("--batch-size", type=int, default=16, help="for the peers' GPT")
    p.add_argument("--layers", type=int, default=4, help="for the peers' GPT")
    p.add_argument("--levers", nargs="+", default=list(DP_LEVERS), choices=sorted(LEVERS),
                   help="the levers to turn off one by one (default: %(default)s)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "peers_gpt.py")
            Path(model).write_text(MODEL.format(layers=args.layers, width=128, heads=4, seq=64,
                                                vocab=512,
                                                batch=args.batch_size))
        times = launch("bench_levers:worker", nproc=args.nproc,
                       args=(model, args.plan, args.steps, tuple(args.levers)),
                       timeout_s=1800)[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"config": vars(args), "median_step_s": med,
              "ratio_to_ddp": {k: v / med["ddp"] for k, v in med.items()},
              "lever": {lv: med["ssdsl"] / med[f"ssdsl-no-{lv}"] for lv in args.levers}}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
