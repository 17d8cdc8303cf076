"""Time the schedule checker and simulator on large pipelines (p = 64, m = 512 by default).

Run: ``.venv/bin/python bench/bench_schedule.py [--p 64] [--m 512]``. Prints one line per
schedule and phase with the number of units and the seconds taken (best of ``--repeat``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from ssdsl.check import check_deadlock, check_structure
from ssdsl.check.deadlock import CommModel
from ssdsl.schedule.builders import gpipe, interleaved_1f1b, one_f_one_b
from ssdsl.schedule.simulate import simulate
from ssdsl.schedule.units import Schedule


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--v", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    p, m = args.p, args.m
    builds: dict[str, Callable[[], Schedule]] = {
        "gpipe": lambda: gpipe(p, m),
        "1f1b": lambda: one_f_one_b(p, m),
        f"interleaved v={args.v}": lambda: interleaved_1f1b(p, m, args.v),
    }
    print(f"p={p} m={m}")
    for name, build in builds.items():
        s = build()
        units = sum(len(prog) for prog in s.programs)
        times = {
            "build": _best(build, args.repeat),
            "structure": _best(lambda: check_structure(s), args.repeat),
            "deadlock(async)": _best(lambda: check_deadlock(s), args.repeat),
            "simulate": _best(lambda: simulate(s), args.repeat),
        }
        if name == "gpipe":
            times["deadlock(rendezvous)"] = _best(
                lambda: check_deadlock(s, comm=CommModel.RENDEZVOUS), args.repeat)
        cols = "  ".join(f"{k} {v:.3f}s" for k, v in times.items())
        print(f"{name:16s} {units:7d} units  {cols}")


if __name__ == "__main__":
    main()
