"""What a step costs under ssdsl beyond the model's own work: one device, one process, ssdsl's
single-device plan against the plain model (eager PyTorch), steps alternating.

    python bench/bench_fixed_cost.py [--model examples/mlp.py] [--plan dp] [--steps 400]
                                     [--warmup 20] [--old PATH]

Both sides train a copy of the model file's model with plain SGD on the same batches; a step is
zero_grad, forward, loss, backward, optimizer step and reading the loss out. They alternate step
by step (which goes first alternates too), so that a loaded machine's changing load hits both
alike. Prints JSON: each side's median step (us), ``ratio`` = ssdsl / eager (the fixed cost per
step shows as the ratio's excess on a small model), and the top-level ATen calls a step makes on
each side (torch.profiler; the calls ssdsl adds: the loss's normalization by its count, the step
values' prologue, the loss read out).

``--old PATH`` runs the same measurement with the ssdsl package found at PATH (a checkout of an
earlier commit, ``git worktree add PATH COMMIT``) in a second process, for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(model: str, plan: str, steps: int, warmup: int) -> dict:
    """Both sides in this process (world 1, no process group of its own needed)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 3000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch

    import ssdsl
    from ssdsl.trace.model_file import load_model_file

    torch.set_num_threads(1)
    mf = load_model_file(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not verified": skipped on purpose
        pm = ssdsl.parallelize(model, plan, optimizer="sgd", lr=0.01, verify=False)
    net = mf.build(seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def eager(inputs, target) -> float:
        opt.zero_grad(set_to_none=True)
        loss = mf.loss(net(*inputs), target)
        loss.backward()
        opt.step()
        return float(loss)

    def ours(inputs, target) -> float:
        return pm.train_step(inputs, target)

    sides = {"eager": eager, "ssdsl": ours}
    batches = [mf.get_batch(s, mf.batch_size) for s in range(4)]
    times: dict[str, list[float]] = {k: [] for k in sides}
    for step in range(steps + warmup):
        inputs, target = batches[step % len(batches)]
        order = ("eager", "ssdsl") if step % 2 else ("ssdsl", "eager")
        for name in order:
            start = time.perf_counter()
            sides[name](inputs, target)
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {"step_us": med, "ratio": med["ssdsl"] / med["eager"],
            "aten_calls_per_step": {k: _aten_calls(fn, batches) for k, fn in sides.items()},
            "ssdsl": str(Path(ssdsl.__file__).parent)}


def _aten_calls(fn, batches, steps: int = 4) -> dict:
    """Top-level ATen calls per step (those not made inside another ATen call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(steps):
            fn(*batches[s % len(batches)])
    calls = Counter(e.name for e in prof.events()
                    if e.cpu_parent is None and e.name.startswith("aten::"))
    return {"total": sum(calls.values()) / steps,
            **{k: v / steps for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "examples" / "mlp.py"))
    p.add_argument("--plan", default="dp")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--old", default=None, help="an earlier checkout to compare with")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    model = str(Path(args.model).resolve())
    report = {"config": {k: v for k, v in vars(args).items() if k != "json_only"},
              "load_1min": os.getloadavg()[0],
              "now": measure(model, args.plan, args.steps, args.warmup)}
    if args.old:
        # the child makes its own one-rank process group (this one holds its port)
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        env["PYTHONPATH"] = str(Path(args.old).resolve())
        out = subprocess.run([sys.executable, __file__, "--model", model, "--plan", args.plan,
                              "--steps", str(args.steps), "--warmup", str(args.warmup),
                              "--json-only"], env=env, check=True, capture_output=True,
                             text=True, cwd=str(Path(args.old).resolve())).stdout
        report["old"] = json.loads(out)["now"]
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
