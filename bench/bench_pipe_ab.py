"""ssdsl's pipeline and torch.distributed.pipelining's in the same ranks, steps alternating: the
bench_peers pipeline pair measured so that a loaded machine's changing load hits both alike.

    python bench/bench_pipe_ab.py [--nproc 2] [--kind 1f1b] [--steps 40] [--warmup 4]
                                  [--off LEVER ...] [--microbatches 4] [--layers 4]

Each rank builds bench_peers' model and pipeline plan under ssdsl (``ssdsl.parallelize``), once
more for each lever in ``--off`` (bench_peers' ``LEVERS``: a planning lever is off while its
plan is made, a runtime lever around each of its steps), and torch's schedule on the same
stages (``bench_peers.pipe_worker``'s); then it runs one step of each side in turn (the order
rotates every step), with a barrier before every step. A step's time is the slowest rank's.
Prints JSON: per side the median step (ms) and CPU time (the mean over ranks of the process's
CPU time, communication threads included) after ``--warmup``; ``ratio`` = the median over
steps of ssdsl / torch step by step, ``ratio_without_LEVER`` the same for ssdsl with LEVER off,
``lever_LEVER`` = the median of ssdsl / ssdsl-without-LEVER (below 1: the lever helps); and
the largest relative difference between the sides' losses.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers as bp  # noqa: E402
from ssdsl.runtime.launch import launch  # noqa: E402


def _torch_side(mf, kind: str, microbatches: int):
    """torch.distributed.pipelining on bench_peers' stages: ``one_step(inputs, target)``."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    model = mf.build(seed=0)
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = 2 if kind == "interleaved" else 1
    total = n * chunks
    k = len(model.h) // total
    ids = [r + c * n for c in range(chunks)]
    subs = [bp._Stage(model, i * k, (i + 1) * k, i == 0, i == total - 1) for i in ids]
    stages = [pp.PipelineStage(sub, i, total, torch.device("cpu")) for sub, i in zip(subs, ids)]
    if kind == "interleaved":
        schedule = pp.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=mf.loss)
    else:
        cls = pp.Schedule1F1B if kind == "1f1b" else pp.ScheduleGPipe
        schedule = cls(stages[0], microbatches, loss_fn=mf.loss)
    opt = torch.optim.SGD([p for s in subs for p in s.parameters()], lr=bp.LR)
    holds_last = any(i == total - 1 for i in ids)

    def one_step(inputs, target):
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if holds_last else {}
        args = tuple(inputs) if 0 in ids else ()
        schedule.step(*args, **kwargs)
        opt.step()
        mine = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.all_reduce(mine)  # one rank holds the loss; share it as ssdsl reports it
        return float(mine)
    return one_step


def ab_worker(model: str, plan: str, kind: str, microbatches: int, steps: int,
              off: tuple[str, ...]) -> dict:
    import torch
    import torch.distributed as dist

    import ssdsl
    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file

    torch.set_num_threads(1)
    mf = load_model_file(model)
    with distributed():
        sides: dict = {}
        runtime: dict[str, tuple] = {}  # side -> (module, attribute, value) set around its steps
        pm = ssdsl.parallelize(model, plan, optimizer="sgd", lr=bp.LR, verify=False)
        sides["ssdsl"] = lambda i, t, pm=pm: pm.train_step(i, t)
        for lever in off:
            module, attr, value = bp.LEVERS[lever]
            mod = importlib.import_module(module)
            keep = getattr(mod, attr)
            setattr(mod, attr, value)
            pm = ssdsl.parallelize(model, plan, optimizer="sgd", lr=bp.LR, verify=False)
            setattr(mod, attr, keep)
            sides[f"ssdsl-no-{lever}"] = lambda i, t, pm=pm: pm.train_step(i, t)
            if module.startswith("ssdsl.runtime."):
                runtime[f"ssdsl-no-{lever}"] = (mod, attr, value)
        sides["torch"] = _torch_side(mf, kind, microbatches)
        names = list(sides)
        out = {s: {"wall": [], "cpu": [], "loss": []} for s in names}
        for step in range(steps):
            inputs, target = mf.get_batch(step, mf.batch_size)
            k = step % len(names)
            for side in names[k:] + names[:k]:
                saved = None
                if side in runtime:
                    mod, attr, value = runtime[side]
                    saved = (mod, attr, getattr(mod, attr))
                    setattr(mod, attr, value)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = float(sides[side](inputs, target))
                out[side]["wall"].append(time.perf_counter() - t0)
                out[side]["cpu"].append(time.process_time() - c0)
                out[side]["loss"].append(loss)
                if saved is not None:
                    setattr(*saved)
        return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--kind", default="1f1b", choices=("1f1b", "gpipe", "interleaved"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--off", nargs="*", default=[], choices=sorted(bp.LEVERS))
    p.add_argument("--stages", default="blocks", choices=("blocks", "auto"),
                   help="ssdsl's cut: at the torch stages' blocks (the executors compared), or "
                        "the stdlib plan's own (`stages into N`, balanced by operator cost: the "
                        "plan as a user runs it, against torch's stages by blocks)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "peers_gpt.py"
        model.write_text(bp.MODEL.format(layers=args.layers, width=128, heads=4, seq=64,
                                         vocab=512, batch=16))
        plan = Path(tmp) / f"bench_{args.kind}.ssp"
        if args.stages == "auto":
            plan.write_text(bp.stdlib_pipeline_plan(args.kind, args.microbatches))
        else:
            plan.write_text(bp.pipeline_plan(args.kind, args.nproc, args.layers,
                                             args.microbatches))
        per_rank = launch("bench_pipe_ab:ab_worker", nproc=args.nproc,
                          args=(str(model), str(plan), args.kind, args.microbatches,
                                args.steps, tuple(args.off)), timeout_s=1800)
    w = args.warmup
    sides = list(per_rank[0])
    wall = {s: [max(x) for x in zip(*(r[s]["wall"] for r in per_rank))][w:] for s in sides}
    cpu = {s: [statistics.fmean(x) for x in zip(*(r[s]["cpu"] for r in per_rank))][w:]
           for s in sides}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(wall[a], wall[b]))
    losses = {s: [statistics.fmean(x) for x in zip(*(r[s]["loss"] for r in per_rank))]
              for s in sides}
    report = {
        "config": vars(args), "load_1min": os.getloadavg()[0],
        "step_ms": {s: statistics.median(v) * 1e3 for s, v in wall.items()},
        "cpu_ms": {s: statistics.median(v) * 1e3 for s, v in cpu.items()},
        "ratio": ratio("ssdsl", "torch"),
        "loss_agreement": max(abs(a - b) / max(abs(b), 1e-12)
                              for a, b in zip(losses["ssdsl"], losses["torch"])),
    }
    for lever in args.off:
        report[f"ratio_without_{lever}"] = ratio(f"ssdsl-no-{lever}", "torch")
        report[f"lever_{lever}"] = ratio("ssdsl", f"ssdsl-no-{lever}")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
