"""Time that verification before launch adds to start-up, against 3 training steps of the job.

    python bench/bench_verify.py [--nproc 2] [--steps 6] [--repeats 3]

For each example (GPT under Megatron tensor parallelism, Swin and a Hugging Face LLaMA under data
parallelism), ``ssdsl run MODEL PLAN --json`` as a user runs it (float32, the ranks on gloo),
``--repeats`` times with verification and as many with ``--no-verify``, alternated (the machine
is shared), after a warm-up. ``ssdsl run`` verifies while the ranks start, and they wait for it
at a gate before their first step (``ssdsl.runtime.gate``), so what verifying adds to the
start-up is how long the ranks stood at the gate (``held_ranks_s`` in the JSON). Printed per
example (medians):

- ``verify_s``: the verification's own time (the launcher's float32 programs simulated in
  float64 for one step of all ranks, the plain model's step, get_batch twice, the scan for
  random operators);
- ``held_ranks_s``: how long the ranks waited for it;
- ``wall_with_s`` / ``wall_without_s``: the whole command's time with and without verification
  (start-up and the steps; noisy, as start-up takes seconds);
- ``three_steps_s``: 3 x the slowest rank's median step time, the yardstick, and the ratios of
  ``held_ranks_s`` and of the wall-time difference to it.

Prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    ("examples/gpt.py", "megatron_tp", ("tp=2",)),
    ("examples/swin.py", "dp", ()),
    ("examples/hf_llama.py", "dp", ()),
)


def run_once(model: str, plan: str, sets: tuple, nproc: int, steps: int, verify: bool
             ) -> tuple[float, dict]:
    """One ``ssdsl run --json``: its wall time and its JSON document."""
    from ssdsl.cli import main
    argv = ["run", str(ROOT / model), plan, "--nproc", str(nproc), "--steps", str(steps),
            "--json", *[a for s in sets for a in ("--set", s)]]
    if not verify:
        argv.append("--no-verify")
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} exited {code}:\n{err.getvalue()[-2000:]}")
    return wall, json.loads(out.getvalue())


def measure(model: str, plan: str, sets: tuple, nproc: int, steps: int, repeats: int) -> dict:
    run_once(model, plan, sets, nproc, steps, True)  # warm-up: imports, caches, page cache
    walls = {True: [], False: []}
    verify_s, held, step_s = [], [], []
    for _ in range(repeats):
        for verify in (True, False):
            wall, doc = run_once(model, plan, sets, nproc, steps, verify)
            walls[verify].append(wall)
            step_s.append(max(r["median_step_ms"] for r in doc["ranks"]) / 1e3)
            if verify:
                v = doc["verify"]
                if v["status"] != "verified":
                    raise SystemExit(f"{model} {plan}: {v['status']}: {v['reason']}")
                verify_s.append(v["seconds"])
                held.append(v["held_ranks_s"])
    three = 3 * statistics.median(step_s)
    held_m = statistics.median(held)
    wall_diff = statistics.median(walls[True]) - statistics.median(walls[False])
    return {"model": model, "plan": plan, "nproc": nproc,
            "verify_s": round(statistics.median(verify_s), 3),
            "held_ranks_s": round(held_m, 3), "held_each_s": [round(h, 3) for h in held],
            "wall_with_s": round(statistics.median(walls[True]), 2),
            "wall_without_s": round(statistics.median(walls[False]), 2),
            "three_steps_s": round(three, 4),
            "held_to_three_steps": round(held_m / three, 2),
            "wall_difference_to_three_steps": round(wall_diff / three, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    print(json.dumps([measure(m, pl, s, a.nproc, a.steps, a.repeats) for m, pl, s in CASES],
                     indent=1))


if __name__ == "__main__":
    main()
