"""Step time of an ssdsl 1F1B pipeline against torch.distributed.pipelining.Schedule1F1B (gloo).

    .venv/bin/python bench/bench_pipeline.py [--nproc 2] [--layers 4] [--width 128]
                                             [--microbatches 4] [--batch-size 16] [--steps 8]
                                             [--warmup 2] [--runs 3]

Both sides train the same GPT (``examples/gpt.py``'s ``build_gpt`` at the given size, the LM head
untied so that torch's stages need no shared weight) with the same stages (``--nproc`` stages of
``layers / nproc`` blocks each; the embeddings go with the first stage, the final norm, head and
loss with the last), the same micro-batch count, the same ranks, SGD. A step's time is the slowest
rank's; a run's is the median over the steps after ``--warmup``; the figure reported is the median
over ``--runs`` fresh launches. Prints JSON with both figures and ``ratio`` = ssdsl / torch.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ssdsl.runtime.launch import launch  # noqa: E402

MODEL = textwrap.dedent('''
    """The benchmark's GPT: examples/gpt.py at a given size, LM head untied."""
    import importlib.util
    import torch

    _spec = importlib.util.spec_from_file_location("_bench_gpt", {gpt!r})
    gpt = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(gpt)

    LAYERS, WIDTH, HEADS, SEQ, VOCAB = {layers}, {width}, {heads}, {seq}, {vocab}
    BATCH_SIZE = {batch}
    INPUT_DIMS = (("batch", "seq"),)

    def build_model():
        model = gpt.build_gpt(n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, block_size=SEQ,
                              vocab=VOCAB)
        model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
        return model

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(1000 + step)
        data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
        return (data[:, :-1],), data[:, 1:]

    def make_optimizer(params):
        return torch.optim.SGD(params, lr=0.01)
''')


def plan_text(nproc: int, layers: int, microbatches: int) -> str:
    """1F1B with stage s = blocks [s*k, (s+1)*k) (stage 0 also the embeddings, the last the head)."""
    k = layers // nproc
    selectors = ", ".join(f"h.{s * k}" for s in range(nproc))
    return textwrap.dedent(f'''
        plan bench_1f1b(stages: int = {nproc}, microbatches: int = {microbatches})
        microbatch along batch into microbatches
        stages {selectors} as st
        for s in 0..stages:
            assign st[s] to device s
            let warm = min(stages - s - 1, microbatches)
            order on device s:
                forward st[s] mb 0..warm,
                interleave(forward st[s] mb warm..microbatches, backward st[s] mb 0..microbatches - warm),
                backward st[s] mb microbatches - warm..microbatches
        ''').lstrip()


class _Stage(torch.nn.Module):
    """Blocks ``lo..hi`` of the GPT, with the embeddings first or the head last."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.lo, self.hi, self.first, self.last = model, lo, hi, first, last
        self.blocks = torch.nn.ModuleList(model.h[lo:hi])
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1])
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def torch_worker(model_path: str, nproc: int, layers: int, microbatches: int, steps: int
                 ) -> list[float]:
    """One rank of the torch.distributed.pipelining run: the time of every step."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file

    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = mf.build(seed=0)
        k, r = layers // nproc, ctx.rank
        sub = _Stage(model, r * k, (r + 1) * k, r == 0, r == nproc - 1)
        stage = PipelineStage(sub, r, nproc, torch.device("cpu"))

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     target.reshape(-1))

        schedule = Schedule1F1B(stage, microbatches, loss_fn=loss_fn)
        opt = torch.optim.SGD(sub.parameters(), lr=0.01)
        times = []
        for step in range(steps):
            (x,), y = mf.get_batch(step, mf.batch_size)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            if r == 0:
                schedule.step(x)
            elif r == nproc - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            times.append(time.perf_counter() - start)
        return times


def ssdsl_worker(model_path: str, plan_path: str, steps: int) -> list[float]:
    """One rank of the ssdsl run (the job API ``ssdsl run`` uses): the time of every step."""
    import torch.distributed as dist

    from ssdsl.runtime import dist as sdist
    from ssdsl.runtime.executor import RankProgram, create_groups
    from ssdsl.runtime.job import JobSpec, plan_job
    from ssdsl.runtime.train import OptimizerSpec

    spec = JobSpec(model_path, plan_path, steps=steps, optimizer="sgd", lr=0.01)
    with sdist.distributed() as ctx:
        mf, m, model = plan_job(spec, ctx.world_size)
        prog = RankProgram(m, ctx.rank, mf, model, dtype=torch.float32,
                           optimizer=OptimizerSpec("sgd", 0.01), groups=create_groups(m))
        times = []
        for step in range(steps):
            dist.barrier()
            start = time.perf_counter()
            prog.step(step, None)
            times.append(time.perf_counter() - start)
        return times


def _run_time(per_rank: list[list[float]], warmup: int) -> float:
    slowest = [max(ts) for ts in zip(*per_rank)]
    return statistics.median(slowest[warmup:])


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The model and run flags the pipeline benchmarks share (bench_pipeline, bench_peers,
    bench_zb): one GPT, its ranks, batch, micro-batches and timed steps."""
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    if args.layers % args.nproc:
        p.error("--layers must be a multiple of --nproc")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "bench_gpt.py"
        model.write_text(MODEL.format(gpt=str(ROOT / "examples" / "gpt.py"), layers=args.layers,
                                      width=args.width, heads=args.heads, seq=args.seq,
                                      vocab=args.vocab, batch=args.batch_size))
        plan = Path(tmp) / "bench_1f1b.ssp"
        plan.write_text(plan_text(args.nproc, args.layers, args.microbatches))
        figures: dict[str, list[float]] = {"torch": [], "ssdsl": []}
        for _ in range(args.runs):
            runs = {"torch": ("bench_pipeline:torch_worker", (str(model), args.nproc, args.layers,
                                             args.microbatches, args.steps)),
                    "ssdsl": ("bench_pipeline:ssdsl_worker", (str(model), str(plan), args.steps))}
            for name, (worker, wargs) in runs.items():
                per_rank = launch(worker, nproc=args.nproc, args=wargs, timeout_s=600)
                figures[name].append(_run_time(per_rank, args.warmup))
    torch_s, ssdsl_s = (statistics.median(figures[k]) for k in ("torch", "ssdsl"))
    result = {"config": vars(args), "machine": f"{platform.machine()}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}",
              "torch_step_s": torch_s, "ssdsl_step_s": ssdsl_s, "ratio": ssdsl_s / torch_s,
              "runs": figures}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
