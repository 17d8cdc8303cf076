"""One lever on and off in the same ranks, steps alternating: an A/B that a loaded machine's
changing load hits alike (gloo, CPU).

    python bench/bench_lever_ab.py MODEL PLAN [--nproc 2] [--steps 40] [--warmup 4]
                                   --lever boundary|own_loss|overlap|rest_parts|early_recv|prebuilt

Each rank builds the plan twice with ``ssdsl.parallelize`` (the lever as it is, and off: the
``LEVERS`` table of ``bench_peers``; a planning lever is off while the second plan is made, a
runtime lever around each of that plan's steps), then alternates one step of each (which goes
first alternates too), with a barrier before every step. A step's time is the slowest rank's;
``CPU`` is the mean over ranks of the process's CPU time for the step (compute and the
communication threads; it does not count waiting, so it moves less with the machine's load).
Prints JSON: medians over the steps after ``--warmup``, ``step_ratio`` = the median of
on / off over step pairs, ``cpu_ratio`` = median CPU on / median CPU off (below 1: the lever
helps), and the largest difference between the two plans' losses (0 for a lever that changes
nothing but speed).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peers import LEVERS  # noqa: E402
from ssdsl.runtime.launch import launch  # noqa: E402


def ab_worker(model: str, plan: str, steps: int, lever: str) -> dict:
    """One rank: both plans, alternating steps; per side the step times, CPU times, losses."""
    import torch
    import torch.distributed as dist

    import ssdsl
    from ssdsl.trace.model_file import load_model_file

    torch.set_num_threads(1)
    mf = load_model_file(model)
    module, attr, value = LEVERS[lever]
    mod = importlib.import_module(module)
    keep = getattr(mod, attr)
    sides = {"on": ssdsl.parallelize(model, plan, optimizer="sgd", lr=0.01, verify=False)}
    setattr(mod, attr, value)
    sides["off"] = ssdsl.parallelize(model, plan, optimizer="sgd", lr=0.01, verify=False)
    setattr(mod, attr, keep)
    runtime = module.startswith("ssdsl.runtime.")
    out = {side: {"wall": [], "cpu": [], "loss": []} for side in sides}
    for s in range(steps):
        batch = mf.get_batch(s, mf.batch_size)
        for side in (("on", "off") if s % 2 else ("off", "on")):
            if runtime:
                setattr(mod, attr, value if side == "off" else keep)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = float(sides[side].train_step(*batch))
            out[side]["wall"].append(time.perf_counter() - t0)
            out[side]["cpu"].append(time.process_time() - c0)
            out[side]["loss"].append(loss)
        setattr(mod, attr, keep)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("plan")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--lever", required=True, choices=sorted(LEVERS))
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    per_rank = launch("bench_lever_ab:ab_worker", nproc=args.nproc,
                      args=(args.model, args.plan, args.steps, args.lever), timeout_s=900)
    w = args.warmup
    wall = {s: [max(x) for x in zip(*(r[s]["wall"] for r in per_rank))][w:] for s in ("on", "off")}
    cpu = {s: [statistics.fmean(x) for x in zip(*(r[s]["cpu"] for r in per_rank))][w:]
           for s in ("on", "off")}
    report = {
        "config": vars(args), "load_1min": os.getloadavg()[0],
        "step_ms": {s: statistics.median(v) * 1e3 for s, v in wall.items()},
        "cpu_ms": {s: statistics.median(v) * 1e3 for s, v in cpu.items()},
        "step_ratio": statistics.median(a / b for a, b in zip(wall["on"], wall["off"])),
        "cpu_ratio": statistics.median(cpu["on"]) / statistics.median(cpu["off"]),
        "loss_difference": max(abs(a - b) for a, b in zip(per_rank[0]["on"]["loss"],
                                                         per_rank[0]["off"]["loss"])),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
