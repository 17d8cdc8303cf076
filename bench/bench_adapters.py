"""Benchmark: how long adapter and reducer planning takes as devices grow (DESIGN §8).

Scenario: a GPT-3-175B-like model (96 layers, hidden 12288, micro-batch of 2048 tokens) planned
for dp x tp x pp devices with Megatron tensor parallelism: per layer, per dp x pp replica, the
adapters of one tensor-parallel group (row-parallel
output all-reduce, sequence-parallel reduce-scatter / all-gather), plus the send/recv between
pipeline stages, plus the weight-gradient reducer over dp. Prints the planning time and the bytes.

    .venv/bin/python bench/bench_adapters.py [--dp 8 --tp 8 --pp 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from ssdsl.ir.layout import Layout
from ssdsl.materialize import Weight, plan_adapter, plan_grad_reducer
from ssdsl.materialize.plan import _plan_normalized
from ssdsl.materialize.rvd import search


def plan_gpt(dp: int, tp: int, pp: int, layers: int = 96, hidden: int = 12288,
             tokens: int = 2048) -> tuple[int, int]:
    """Plan every adapter and reducer; returns (number of adapters, total bytes per step)."""
    act = (tokens, hidden)
    dtype = torch.bfloat16
    n, nbytes = 0, 0
    per_stage = layers // pp
    for d in range(dp):
        for s in range(pp):
            base = (d * pp + s) * tp
            devs = list(range(base, base + tp))
            part = Layout.build(act, devs, v=tp).placements()
            full = Layout.build(act, devs, r=tp).placements()
            seq = Layout.build(act, devs, d=(tp, 1)).placements()
            for _ in range(per_stage):
                for src, dst in ((part, full), (part, seq), (seq, full), (full, seq)):
                    ad = plan_adapter(act, dtype, src, dst)
                    n += 1
                    nbytes += ad.nbytes + ad.backward.nbytes
            if s + 1 < pp:
                nxt = list(range(base + tp, base + 2 * tp))
                ad = plan_adapter(act, dtype, full, Layout.build(act, nxt, r=tp).placements())
                n += 1
                nbytes += ad.nbytes + ad.backward.nbytes
    weights = []
    for layer in range(layers):
        s = layer // per_stage
        for name, shape in (("qkv", (3 * hidden, hidden)), ("proj", (hidden, hidden)),
                            ("fc", (4 * hidden, hidden)), ("fc2", (hidden, 4 * hidden))):
            pl = []
            for d in range(dp):
                base = (d * pp + s) * tp
                pl += Layout.build(shape, range(base, base + tp), d=(tp, 1)).placements()
            weights.append(Weight(f"h.{layer}.{name}", shape, dtype, tuple(pl)))
    red = plan_grad_reducer(weights)
    return n + len(red.buckets), nbytes + red.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=16)
    args = ap.parse_args()
    for tp in sorted({8, 16, 32, args.tp}):
        _plan_normalized.cache_clear()
        search.cache_clear()
        t0 = time.perf_counter()
        n, nbytes = plan_gpt(args.dp, tp, args.pp)
        dt = time.perf_counter() - t0
        print(f"dp{args.dp} x tp{tp} x pp{args.pp} = {args.dp * tp * args.pp:5d} devices: "
              f"{n:6d} adapters/buckets planned in {dt:6.2f} s, {nbytes / 2**30:8.1f} GiB per step")


if __name__ == "__main__":
    main()
