"""Fuzz the front end (and, for plans that survive it, the graph phases) with mutated stdlib plans.

Every mutated plan must either be accepted or be refused with an ``SsdslError``: any other
exception, or a plan that takes longer than ``--hang-s``, is a bug. Prints the number of plans
tried, the time, how many were refused, accepted, and the count of non-domain exceptions (which
must be 0), with the first few written to ``--out`` for reproduction.

    python bench/bench_fuzz.py --plans 100000 --seed 0                 # front end only
    python bench/bench_fuzz.py --plans 2000 --graph-every 1 --model examples/mlp.py

Mutations are drawn from the plan's own tokens and from a list of troublesome ones (huge and
negative numbers, keywords out of place, brackets, indentation), so most plans stay close to
valid text and reach deep into elaboration.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import sys
import time
import traceback
from pathlib import Path

from ssdsl.elaborate import elaborate
from ssdsl.errors import SsdslError
from ssdsl.parse import KEYWORDS, parse_text
from ssdsl.resources import stdlib_dir

EXTRA = ["0", "1", "2", "-1", "3.5", "1000000000", "99999999999999999999", "1e999", "world",
         "world * world", "(", ")", "[", "]", "{", "}", ",", ":", "=", "..", "..=", ".", "*", "**",
         "//", "%", "+", "-", "==", "<", "|", "&", "\n", "\n    ", "    ", '"x"', '"h.*"',
         "st", "m", "mb", "min(", "len(", "interleave(", "#", "\t", "\\\n", "@", "\xff", "st[0]",
         "mesh", "part 0 of", "except", "rest", "all"]
TOKEN = re.compile(r"\s+|\w+|\.\.=?|//|==|!=|<=|>=|\*\*|\S")


class _Hang(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise _Hang


def mutate(text: str, rng: random.Random) -> str:
    """``text`` with 1-4 token-level mutations (delete, insert, replace, duplicate, swap lines)."""
    tokens = TOKEN.findall(text)
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["delete", "insert", "replace", "duplicate", "swap_lines", "number"])
        i = rng.randrange(len(tokens)) if tokens else 0
        if kind == "delete" and tokens:
            del tokens[i:i + rng.randint(1, 3)]
        elif kind == "insert":
            tokens.insert(i, rng.choice(EXTRA + list(KEYWORDS) + tokens[:50]))
        elif kind == "replace" and tokens:
            tokens[i] = rng.choice(EXTRA + list(KEYWORDS))
        elif kind == "duplicate" and tokens:
            j = min(len(tokens), i + rng.randint(1, 12))
            tokens[i:i] = tokens[i:j]
        elif kind == "number":
            nums = [k for k, t in enumerate(tokens) if t.isdigit()]
            if nums:
                tokens[rng.choice(nums)] = rng.choice(["0", "-3", "65537", "10" * 10, "7"])
        elif kind == "swap_lines":
            lines = "".join(tokens).split("\n")
            a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
            lines[a], lines[b] = lines[b], lines[a]
            tokens = TOKEN.findall("\n".join(lines))
    return "".join(tokens)


def run_one(text: str, world: int, graph, hang_s: float) -> str:
    """'refused', 'accepted' (and 'graph-refused' / 'graph-accepted'), or raises a non-domain
    exception (or ``_Hang``)."""
    signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        try:
            plan = elaborate(parse_text(text, "fuzz.ssp"), world=world, max_steps=50_000)
        except SsdslError as err:
            err.render()
            return "refused"
        if graph is None:
            return "accepted"
        from ssdsl.materialize.program import materialize
        from ssdsl.runtime.job import schedule_plan
        try:
            t, lowered = schedule_plan(graph, plan)
            materialize(t, schedule=lowered)
        except SsdslError as err:
            err.render()
            return "graph-refused"
        return "graph-accepted"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=20.0)
    ap.add_argument("--graph-every", type=int, default=0,
                    help="send every N-th accepted plan through the graph phases (0: never)")
    ap.add_argument("--model", default="examples/gpt.py")
    ap.add_argument("--out", default="fuzz_failures.txt")
    ap.add_argument("--report-every", type=int, default=10_000)
    args = ap.parse_args(argv)

    sources = [p.read_text() for p in sorted(stdlib_dir().glob("*.ssp"))]
    graph = None
    if args.graph_every:
        from ssdsl.trace import trace
        from ssdsl.trace.model_file import load_model_file
        graph = trace(load_model_file(args.model), device="meta")
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    failures: list[str] = []
    accepted = 0
    start = time.perf_counter()
    for n in range(1, args.plans + 1):
        text = mutate(rng.choice(sources), rng)
        world = rng.choice([1, 2, 4, 8])
        use_graph = graph if args.graph_every and accepted % args.graph_every == 0 else None
        try:
            outcome = run_one(text, world, use_graph, args.hang_s)
        except _Hang:
            outcome = "HANG"
            failures.append(f"--- plan {n} (world {world}) took over {args.hang_s} s\n{text}")
        except (Exception, RecursionError) as exc:  # noqa: BLE001 - what the bench hunts
            outcome = "NON-DOMAIN " + type(exc).__name__
            failures.append(f"--- plan {n} (world {world})\n{text}\n"
                            + "".join(traceback.format_exception(exc)))
        if outcome.startswith("accepted") or outcome.startswith("graph"):
            accepted += 1
        counts[outcome] = counts.get(outcome, 0) + 1
        if n % args.report_every == 0:
            print(f"{n:>8} plans  {time.perf_counter() - start:8.1f} s  {counts}", flush=True)
    elapsed = time.perf_counter() - start
    bad = sum(v for k, v in counts.items() if k.startswith(("NON-DOMAIN", "HANG")))
    print(f"plans tried: {args.plans}, time: {elapsed:.1f} s "
          f"({args.plans / elapsed:.0f} plans/s), outcomes: {counts}")
    print(f"non-domain exceptions and hangs: {bad}")
    if failures:
        Path(args.out).write_text("\n\n".join(failures[:50]))
        print(f"first {min(50, len(failures))} written to {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
