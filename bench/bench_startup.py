"""Start-up of a job: ranks forked by the fork server against ranks spawned as fresh interpreters.

    python bench/bench_startup.py [--rounds 3] [--nproc 2] [--model examples/gpt.py] [--plan dp]

Two measurements, each side alternating with the other round by round (``SSDSL_FORK_SERVER``
1 or 0), each run in a fresh Python process:

- ``launch``: ``ssdsl.runtime.launch.launch`` of a worker that only imports torch and returns,
  five times in one process: the first launch (which starts the server, or spawns) and the
  median of the next four (a test process or script that launches many jobs);
- ``run``: the whole command ``ssdsl run MODEL PLAN --world N --steps 1``, its wall time
  (planning, verification, start-up and one step).

Prints JSON: per measurement and side the median over rounds (seconds) and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAUNCHES = r'''
import json, statistics, sys, time
sys.path.insert(0, {root!r})
from ssdsl.runtime.launch import launch
times = []
for _ in range(5):
    start = time.perf_counter()
    launch("torch:get_num_threads", nproc={nproc})
    times.append(time.perf_counter() - start)
print(json.dumps({{"first": times[0], "again": statistics.median(times[1:])}}))
'''


def _launches(nproc: int, server: str) -> dict:
    env = dict(os.environ, SSDSL_FORK_SERVER=server)
    out = subprocess.run([sys.executable, "-c", LAUNCHES.format(root=str(ROOT), nproc=nproc)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(model: str, plan: str, nproc: int, server: str) -> float:
    env = dict(os.environ, SSDSL_FORK_SERVER=server, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ssdsl", "run", model, plan, "--world", str(nproc),
                    "--steps", "1"], env=env, capture_output=True, check=True, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="examples/gpt.py")
    p.add_argument("--plan", default="dp")
    a = p.parse_args()
    sides = {"forked": "1", "spawned": "0"}
    first = {s: [] for s in sides}
    again = {s: [] for s in sides}
    run = {s: [] for s in sides}
    for r in range(a.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            got = _launches(a.nproc, sides[side])
            first[side].append(round(got["first"], 3))
            again[side].append(round(got["again"], 3))
            run[side].append(round(_run(a.model, a.plan, a.nproc, sides[side]), 3))
            print(side, first[side][-1], again[side][-1], run[side][-1], file=sys.stderr,
                  flush=True)
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    print(json.dumps({
        "nproc": a.nproc, "model": a.model, "plan": a.plan, "rounds": a.rounds,
        "launch_first_s": {s: med(first[s]) for s in sides},
        "launch_again_s": {s: med(again[s]) for s in sides},
        "run_s": {s: med(run[s]) for s in sides},
        "all": {"launch_first": first, "launch_again": again, "run": run},
    }, indent=1))


if __name__ == "__main__":
    main()
