"""Model state per rank and step time of ZeRO plans on gloo, side by side: dp, dp_zero stage 1,
2 and 3, and torch FSDP2 (``fully_shard`` per transformer block, as FSDP is used).

    PYTHONPATH=. .venv/bin/python bench/bench_zero.py [--model bench/gpt_small.py]
        [--nprocs 4 2] [--batch-size 16] [--steps 2] [--rounds 6] [--warmup-rounds 1]
        [--only dp zero1 zero2 zero3 fsdp2]

For each ``--nprocs`` value, ONE launch of that many gloo ranks builds every variant on the
same ranks (same model file, same seeded initial state, the model file's optimizer: AdamW for
gpt_small.py, two moments per element) and runs them round-robin: each round runs ``--steps``
steps of every variant, the order rotating from round to round, so that load from elsewhere on
the machine falls on all of them alike. A step's time is the slowest rank's (a barrier before
each step); the figure is the median over the rounds after ``--warmup-rounds``. After the last
round each rank reports the bytes of parameters, gradients and optimizer state it holds
(``ssdsl.runtime.zero.model_state_bytes``; for FSDP2 the local shards of its DTensors).
Prints JSON; ``ratio_state_over_dp`` is rank 0's model-state bytes over dp's,
``ratio_step_over_fsdp2`` the median step time over FSDP2's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ssdsl.runtime.launch import launch

ROOT = Path(__file__).resolve().parent.parent
PLANS = {"dp": ("dp", ()), "zero1": ("dp_zero", (("stage", "1"),)),
         "zero2": ("dp_zero", (("stage", "2"),)), "zero3": ("dp_zero", (("stage", "3"),))}
VARIANTS = ("dp", "zero1", "zero2", "zero3", "fsdp2")


def _ssdsl_variant(spec, ctx, batch_size: int):
    """An ssdsl rank program of ``spec``: (step function, model-state function)."""
    from ssdsl.runtime.executor import RankProgram, create_groups
    from ssdsl.runtime.job import plan_with_state
    from ssdsl.runtime.train import OptimizerSpec
    mf, m, init = plan_with_state(spec, ctx)
    prog = RankProgram(m, ctx.rank, mf, init, dtype=torch.float32,
                       optimizer=OptimizerSpec("model"), groups=create_groups(m))
    return (lambda step: prog.step(step, batch_size)), prog.model_state_bytes


def _fsdp2_variant(model_path: str, ctx, batch_size: int):
    """Torch FSDP2 on the same model: every block and the root ``fully_shard``-ed."""
    from torch.distributed.fsdp import fully_shard

    from ssdsl.runtime.train import OptimizerSpec, build_optimizer
    from ssdsl.trace.model_file import load_model_file
    mf = load_model_file(model_path)
    model = mf.build(seed=0)
    for module in model.modules():
        if type(module).__name__ == "Block":
            fully_shard(module)
    fully_shard(model)
    opt = build_optimizer(OptimizerSpec("model"), mf, model.parameters())
    share = batch_size // ctx.world_size
    rows = slice(ctx.rank * share, (ctx.rank + 1) * share)

    def step(k: int) -> None:
        inputs, target = mf.get_batch(k, batch_size)
        opt.zero_grad(set_to_none=True)
        mf.loss(model(*(t[rows] for t in inputs)), target[rows]).backward()
        opt.step()
    return step, lambda: _fsdp_state_bytes(model, opt)


def round_robin_worker(specs: dict, model_path: str, batch_size: int, steps: int,
                       rounds: int) -> dict:
    """One rank: every variant built, then ``rounds`` rounds of ``steps`` steps of each, the
    order rotating; per variant the step times (round, seconds) and the model state held."""
    from ssdsl.runtime.dist import distributed
    with distributed() as ctx:
        variants = {name: (_fsdp2_variant(model_path, ctx, batch_size) if name == "fsdp2"
                           else _ssdsl_variant(spec, ctx, batch_size))
                    for name, spec in specs.items()}
        names = list(variants)
        times: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
        done = {n: 0 for n in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                run, _ = variants[name]
                for _ in range(steps):
                    torch.distributed.barrier()
                    t0 = time.perf_counter()
                    run(done[name])
                    times[name].append((r, time.perf_counter() - t0))
                    done[name] += 1
        return {"step_s": times, "state": {n: held() for n, (_, held) in variants.items()}}


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


def measure(names, model_path: str, *, nproc: int, batch_size: int, steps: int, rounds: int,
            warmup_rounds: int) -> dict:
    """Every variant of ``names`` on one launch of ``nproc`` ranks, round-robin."""
    from ssdsl.runtime.job import JobSpec, launch_files
    with contextlib.ExitStack() as stack:
        specs = {}
        for name in names:
            if name == "fsdp2":
                specs[name] = None
                continue
            plan, sets = PLANS[name]
            planned = stack.enter_context(
                launch_files(JobSpec(model_path, plan, sets=sets, batch_size=batch_size), nproc))
            specs[name] = planned.spec
        per_rank = launch("bench_zero:round_robin_worker", nproc=nproc,
                          args=(specs, model_path, batch_size, steps, rounds), timeout_s=1800)
    out = {}
    for name in names:
        per = [rk["step_s"][name] for rk in per_rank]  # (round, seconds) per step, per rank
        slowest = [(xs[0][0], max(t for _, t in xs)) for xs in zip(*per)]
        kept = [t for r, t in slowest if r >= warmup_rounds]
        out[name] = {"median_step_s": statistics.median(kept), "steps_timed": len(kept),
                     "state_bytes_per_rank": [rk["state"][name] for rk in per_rank]}
    if "dp" in out:
        dp = out["dp"]["state_bytes_per_rank"][0]["total"]
        for r in out.values():
            r["ratio_state_over_dp"] = r["state_bytes_per_rank"][0]["total"] / dp
    if "fsdp2" in out:
        f = out["fsdp2"]["median_step_s"]
        for r in out.values():
            r["ratio_step_over_fsdp2"] = r["median_step_s"] / f
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "bench" / "gpt_small.py"))
    parser.add_argument("--nprocs", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    if any(args.batch_size % n for n in args.nprocs):
        parser.error("--batch-size must be a multiple of every --nprocs value")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks import bench_zero
    results = {str(n): measure(args.only, args.model, nproc=n, batch_size=args.batch_size,
                               steps=args.steps, rounds=args.rounds,
                               warmup_rounds=args.warmup_rounds) for n in args.nprocs}
    json.dump({"model": args.model, "nprocs": args.nprocs, "batch_size": args.batch_size,
               "steps_per_round": args.steps, "rounds": args.rounds,
               "warmup_rounds": args.warmup_rounds, "backend": "gloo",
               "torch": torch.__version__, "machine": platform.machine(),
               "results": results}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
