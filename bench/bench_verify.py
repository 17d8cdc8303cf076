"""Time that verification before launch adds to start-up, against 3 training steps of the job.

    python bench/bench_verify.py [--nproc 2] [--steps 6]

For each example (GPT under Megatron tensor parallelism, Swin and a Hugging Face LLaMA under data
parallelism): ``verify_before_launch`` with verification on (plan in float64, get_batch twice,
random-operator scan, one simulated step of all ranks, the plain model's step) and off (plan
only), medians of ``--repeats`` alternated runs after a warm-up, each from the launcher's one plan
(``launch_files``: state file, trace in the run's dtype, plan, programs checked); the difference
is what verification adds (a float64 plan when the run is not float64, the simulated step and
the plain model's step). Then the job trains ``--steps`` steps on
``--nproc`` gloo ranks (float32, as ``ssdsl run`` does by default), and 3 x the slowest rank's
median step time is the yardstick. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    ("examples/gpt.py", "megatron_tp", (("tp", "2"),)),
    ("examples/swin.py", "dp", ()),
    ("examples/hf_llama.py", "dp", ()),
)


def measure(model: str, plan: str, sets: tuple, nproc: int, steps: int,
            repeats: int) -> dict:
    from ssdsl.runtime.job import JobSpec, launch_files, rank_main
    from ssdsl.runtime.launch import launch
    from ssdsl.runtime.preflight import verify_before_launch

    spec = JobSpec(str(ROOT / model), plan, sets, steps=steps)
    with launch_files(spec, nproc):  # warm-up: imports, lazy torch set-up
        pass
    plans, verifies = [], []
    for _ in range(repeats):  # alternated, medians: the machine is shared
        start = time.perf_counter()
        with launch_files(spec, nproc) as planned:  # what ``ssdsl run`` does without verifying
            verify_before_launch(spec, nproc, enabled=False, planned=planned.m)
        plans.append(time.perf_counter() - start)
        start = time.perf_counter()
        with launch_files(spec, nproc) as planned:
            v = verify_before_launch(spec, nproc, planned=planned.m)
        verifies.append(time.perf_counter() - start)
    plan_only, with_verify = statistics.median(plans), statistics.median(verifies)
    with launch_files(spec, nproc) as planned:
        result = launch(rank_main, nproc=nproc, args=(planned.spec,), timeout_s=900)[0]
    step = max(r.median_step_s for r in result["ranks"])
    return {"model": model, "plan": plan, "nproc": nproc, "status": v.status, "reason": v.reason,
            "plan_only_s": round(plan_only, 3), "plan_and_verify_s": round(with_verify, 3),
            "verify_adds_s": round(with_verify - plan_only, 3),
            "median_step_s": round(step, 4), "three_steps_s": round(3 * step, 4),
            "ratio_to_three_steps": round((with_verify - plan_only) / (3 * step), 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    print(json.dumps([measure(m, pl, s, a.nproc, a.steps, a.repeats) for m, pl, s in CASES], indent=1))


if __name__ == "__main__":
    main()
