"""Benchmark: elaborate a plan whose loops make 100,000 directives (target: under 2 s).

    .venv/bin/python bench/bench_elaborate.py [--layers 1000] [--parts 100] [--repeat 3]

The plan partitions and assigns the parts of each of `layers` blocks to `parts` devices, and gives
every device an order sequence, the shape of a large tensor-parallel plan written with loops.
Prints the parse and elaboration times and the directive count (JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import time

from ssdsl.elaborate import elaborate
from ssdsl.parse import parse_text

PLAN = """\
plan big(layers: int = 1000, parts: int = world)
microbatch along batch into 4
stages into 1 as st
for l in 0..layers:
    partition h.{l}.mlp.fc along out into parts
    for i in 0..parts - 1:
        assign part i of h.{l}.mlp.fc to device i
for d in 0..parts:
    order on device d: forward st[0] mb 0..4, backward st[0] mb 0..4
"""


def run(layers: int, parts: int) -> dict[str, float | int]:
    t0 = time.perf_counter()
    parsed = parse_text(PLAN, "big.ssp")
    t1 = time.perf_counter()
    plan = elaborate(parsed, world=parts, sets={"layers": str(layers)})
    t2 = time.perf_counter()
    return {"directives": len(plan.directives), "parse_s": t1 - t0, "elaborate_s": t2 - t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--parts", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs = [run(args.layers, args.parts) for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["elaborate_s"])
    if args.json:
        print(json.dumps({"runs": runs, "best": best}))
        return
    print(f"{best['directives']:,} directives: parse {best['parse_s'] * 1e3:.1f} ms, "
          f"elaborate {best['elaborate_s']:.3f} s (best of {args.repeat}; "
          f"{best['elaborate_s'] / best['directives'] * 1e6:.2f} us per directive)")


if __name__ == "__main__":
    main()
