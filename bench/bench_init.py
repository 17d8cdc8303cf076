"""Peak memory of a rank while planning and initialising a model far larger than its shards.

    python bench/bench_init.py [--nproc 4] [--blocks 16] [--width 1024]

``bench/wide_mlp.py`` (blocks of Linear(D, 4D), GELU, Linear(4D, D)) under Megatron-style tensor
parallelism over ``--nproc`` ranks (every linear split, so a rank holds 1/N of the parameters).
Three launches of one training step each (SGD, so no optimizer state):

- ``launcher file``: as ``ssdsl run --nproc`` does: the launching process writes the seeded
  model's state once, ranks plan on ``meta`` and read their regions out of the file;
- ``torchrun path``: no launcher file: a child process of local rank 0 writes it, every rank
  reads its regions from it;
- ``baseline``: the same ranks on a 1-block, D=64 model (the cost of torch, tracing and gloo).

Prints JSON: the full model's parameter bytes, one rank's shard bytes, and each rank's peak RSS
(``ru_maxrss``) for each launch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "bench" / "wide_mlp.py")
PLAN = """plan wide_tp(tp: int = world)
partition blocks.* except blocks.*.fc2 along out into tp
partition blocks.*.fc2 along in into tp
replicate rest into tp
assign each part i to device i
"""


def _worker(spec) -> dict:
    """A rank: plan, initialise its shards, train one step, and report its own peak RSS after
    initialisation and after the step (before results are gathered: rank 0 assembles the full
    parameters for the caller, which is not initialisation). ``VmHWM`` is the peak of this
    process's memory; ``ru_maxrss`` is not used: Linux keeps the launcher's RSS at fork in it."""
    from ssdsl.runtime import dist as sdist
    from ssdsl.runtime.executor import RankProgram, create_groups
    from ssdsl.runtime.job import DTYPES, plan_with_state
    from ssdsl.runtime.train import OptimizerSpec

    def hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    with sdist.distributed() as ctx:
        mf, m, source = plan_with_state(spec, ctx)
        prog = RankProgram(m, ctx.rank, mf, source, dtype=DTYPES[spec.dtype],
                           optimizer=OptimizerSpec(spec.optimizer, spec.lr),
                           groups=create_groups(m))
        del source
        after_init = hwm()
        held = sum(t.numel() * t.element_size() for t in prog.state.leaves.values())
        prog.step(0, spec.batch_size)
        return {"peak_after_init": after_init, "peak_after_step": hwm(), "shard_bytes": held}


def _peak(spec, nproc: int, init_file: str | None) -> list[dict]:
    import attrs

    from ssdsl.runtime.launch import launch

    return launch("bench_init:_worker", nproc=nproc,
                  args=(attrs.evolve(spec, init_file=init_file),), timeout_s=900)


def _case(case: str, nproc: int) -> dict:
    """One configuration, in this process (the model file reads its size at import)."""
    sys.path.insert(0, str(ROOT))
    from ssdsl.runtime.init import initial_state_file
    from ssdsl.runtime.job import JobSpec
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(MODEL)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "wide_tp.ssp"
        plan.write_text(PLAN)
        spec = JobSpec(MODEL, str(plan), steps=1, optimizer="sgd")
        full = sum(t.numel() * t.element_size() for t in mf.build(seed=0).parameters())
        out["full_model_bytes"] = full
        with initial_state_file(mf, seed=0) as f:
            out["launcher_file_peak_rss"] = _peak(spec, nproc, f)
        if case == "big":
            out["torchrun_path_peak_rss"] = _peak(spec, nproc, None)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--case", choices=("baseline", "big"), default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        print(json.dumps(_case(a.case, a.nproc)))
        return
    out: dict = {"nproc": a.nproc, "blocks": a.blocks, "width": a.width}
    for case, d, blocks in (("baseline", 64, 1), ("big", a.width, a.blocks)):
        env = dict(os.environ, WIDE_MLP_D=str(d), WIDE_MLP_BLOCKS=str(blocks))
        res = subprocess.run([sys.executable, __file__, "--case", case, "--nproc", str(a.nproc)],
                             env=env, check=True, capture_output=True, text=True)
        out[case] = json.loads(res.stdout.strip().splitlines()[-1])
    big = out["big"]
    base = max(r["peak_after_init"] for r in out["baseline"]["launcher_file_peak_rss"])
    out["shard_bytes_per_rank"] = big["full_model_bytes"] // a.nproc
    for path in ("launcher_file", "torchrun_path"):
        out[f"{path}_init_extra_over_baseline"] = [r["peak_after_init"] - base
                                                   for r in big[f"{path}_peak_rss"]]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
