"""Gloo's all_reduce against ssdsl's all-reduce by exchanges (``ssdsl.runtime.exchange``), alone.

    python bench/bench_exchange.py [--nproc 2 4] [--kib 4 512 1024 4096] [--reps 50]
                                   [--compute 0]

For each world size and tensor size, every rank sums a float32 tensor ``--reps`` times with
``torch.distributed.all_reduce`` and ``--reps`` times with ``exchange.all_reduce`` forced on
(its size limit lifted), the two alternating in blocks of ten after a barrier; ``--compute N``
puts N small matmuls (about a millisecond each here) before each all-reduce, the second rank
doing a third more every other time (a skew like a real step's). Prints JSON: per world and size,
the median over ranks of wall and CPU milliseconds per all-reduce (CPU: the process's, so gloo's
threads count; the compute's is taken out), and whether every rank ended with the same tensor
to the bit as the others under both (it must, for replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ssdsl.runtime.launch import launch  # noqa: E402


def worker(kib: list[int], reps: int, compute: int) -> dict:
    import torch.distributed as dist

    from ssdsl.runtime import exchange
    from ssdsl.runtime.dist import distributed

    torch.set_num_threads(1)
    out = {}
    with distributed() as ctx:
        exchange.MAX_BYTES = 1 << 62
        r = ctx.rank
        a, w = torch.randn(256, 128), torch.randn(128, 128)

        def work(i):
            n = compute + (compute // 3 if (i + r) % 2 else 0)
            t = time.process_time()
            for _ in range(n):
                a.matmul(w)
            return time.process_time() - t

        for k in kib:
            x0 = torch.randn(k * 256, generator=torch.Generator().manual_seed(r))
            tools = {"gloo": lambda x: dist.all_reduce(x), "exchange": exchange.all_reduce}
            wall = {name: 0.0 for name in tools}
            cpu = {name: 0.0 for name in tools}
            same = {}
            for name, fn in tools.items():
                x = x0.clone()
                fn(x)
                got = [torch.empty_like(x) for _ in range(ctx.world_size)]
                dist.all_gather(got, x)
                same[name] = all(torch.equal(got[0], g) for g in got)
            for block in range(reps // 10):
                for name, fn in tools.items():
                    x = x0.clone()
                    dist.barrier()
                    c, t, spent = time.process_time(), time.perf_counter(), 0.0
                    for i in range(10):
                        spent += work(i)
                        fn(x)
                    wall[name] += time.perf_counter() - t - spent
                    cpu[name] += time.process_time() - c - spent
            n = (reps // 10) * 10
            out[k] = {name: (wall[name] / n * 1e3, cpu[name] / n * 1e3, same[name])
                      for name in tools}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="*", default=[2, 4])
    p.add_argument("--kib", type=int, nargs="*", default=[4, 512, 1024, 4096])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--compute", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, 1 thread per rank",
           "compute": args.compute, "worlds": {}}
    for n in args.nproc:
        per_rank = launch("bench_exchange:worker", nproc=n,
                          args=(args.kib, args.reps, args.compute), timeout_s=900)
        rows = {}
        for k in args.kib:
            row = {}
            for name in ("gloo", "exchange"):
                got = [pr[k][name] for pr in per_rank]
                row[name] = {"wall_ms": round(statistics.median(g[0] for g in got), 3),
                             "cpu_ms": round(statistics.median(g[1] for g in got), 3),
                             "same_on_every_rank": all(g[2] for g in got)}
            row["wall_ratio"] = round(row["exchange"]["wall_ms"] / row["gloo"]["wall_ms"], 3)
            rows[f"{k} KiB"] = row
        res["worlds"][str(n)] = rows
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
