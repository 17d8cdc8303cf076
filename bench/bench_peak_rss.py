"""A process's peak memory over a few training steps on one device: plain eager PyTorch against
ssdsl's single-device plan, with and without the executor dropping forward values no later
instruction reads before each backward (``ssdsl.runtime.liveness``).

    python bench/bench_peak_rss.py [--model PATH] [--steps 3] [--repeats 3]

Default model: the peers' GPT (``bench_peers.MODEL``) at width 256, seq 256, vocabulary 4,096 and
batch 32, whose logits (134 MB) dominate its activations. Each variant runs in a fresh process
(one thread, float32, SGD): one step, then ``--steps`` more; the figure is the process's peak
resident set (``ru_maxrss``) at the end, the median of ``--repeats`` processes. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("eager", "ssdsl", "ssdsl_no_drop")


def one(model: str, variant: str, steps: int) -> float:
    """Run in this process: the peak RSS in MB after ``steps`` + 1 steps of ``variant``."""
    import resource
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 3000),
                      RANK="0", WORLD_SIZE="1")
    sys.path.insert(0, str(ROOT))
    import torch

    import ssdsl
    from ssdsl.runtime import liveness
    from ssdsl.trace.model_file import load_model_file

    torch.set_num_threads(1)
    mf = load_model_file(model)
    batches = [mf.get_batch(s, mf.batch_size) for s in range(steps + 1)]
    if variant == "eager":
        net = mf.build(seed=0)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step(inputs, target):
            opt.zero_grad(set_to_none=True)
            loss = mf.loss(net(*inputs), target)
            loss.backward()
            opt.step()
    else:
        liveness.ENABLED = variant == "ssdsl"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not verified": skipped on purpose
            pm = ssdsl.parallelize(model, "dp", optimizer="sgd", lr=0.01, verify=False)

        def step(inputs, target):
            pm.train_step(inputs, target)
    for b in batches:
        step(*b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model file (default: the peers' GPT)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(one(args.one[0], args.one[1], args.steps))
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import bench_peers as bp
            model = str(Path(tmp) / "peers_gpt_wide.py")
            Path(model).write_text(bp.MODEL.format(layers=4, width=256, heads=4, seq=256,
                                                   vocab=4096, batch=32))
        peaks: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v in VARIANTS:
                out = subprocess.run([sys.executable, __file__, "--one", model, v,
                                      "--steps", str(args.steps)],
                                     capture_output=True, text=True, check=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
                peaks[v].append(float(out.stdout.strip().splitlines()[-1]))
    med = {v: statistics.median(x) for v, x in peaks.items()}
    result = {"config": vars(args) | {"model": args.model or "peers GPT 4 x 256, seq 256, "
                                                          "vocab 4096, batch 32"},
              "peak_mb": med, "runs_mb": peaks,
              "over_eager_mb": {v: med[v] - med["eager"] for v in VARIANTS[1:]}}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
