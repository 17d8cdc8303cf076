"""ssdsl against what a user would pick instead, side by side in one run (gloo, CPU).

    python bench/bench_peers.py [--nproc 2] [--rounds 3] [--steps 8] [--warmup 2]
                                [--only eager dp tp 1f1b gpipe interleaved] [--off LEVER ...]
                                [--peer-hostmem]

Every pair trains the same model file (a nanoGPT-style decoder: separate q/k/v projections so
that torch's column/row-parallel styles apply, an untied LM head so that torch's pipeline stages
need no shared weight) with the same weights, batches, plain SGD, ranks and threads per rank
(one). The pairs, each as (ssdsl plan, peer):

| pair        | ssdsl                          | peer                                              |
|-------------|--------------------------------|---------------------------------------------------|
| eager       | `dp` on 1 rank                 | the plain model in one process                    |
| dp          | `dp`                           | `DistributedDataParallel`                         |
| tp          | `megatron_tp`                  | DTensor `parallelize_module` (Colwise / Rowwise)  |
| 1f1b        | 1F1B, one stage per rank       | `torch.distributed.pipelining.Schedule1F1B`       |
| gpipe       | GPipe, one stage per rank      | `ScheduleGPipe`                                   |
| interleaved | interleaved 1F1B, 2 chunks     | `ScheduleInterleaved1F1B`                         |

Pipelines cut at the same blocks on both sides (embeddings with the first stage, final norm,
head and loss with the last). Rounds go round-robin over the tools (each round launches every
measurement once, fresh), so that a change in the machine's load hits both sides of a pair. A
step's time is the slowest rank's; a launch's figure is the median over the steps after
``--warmup``; a tool's figure is the median over ``--rounds`` launches. The loss of every step is
recorded on both sides; ``loss_agreement`` is the largest relative difference of a pair's losses.
Prints JSON: per pair both step times and ``ratio`` = ssdsl / peer. ``--off LEVER`` adds, in
the same rounds, ssdsl with that lever turned off (``LEVERS``): ``lever_LEVER`` is ssdsl /
ssdsl without it (below 1: the lever helps), ``ratio_without_LEVER`` the ratio it would have.

ssdsl's ranks keep the host memory a step frees for the next (``ssdsl.runtime.hostmem``: glibc's
thresholds fixed), which the peers, run as a user runs them, do not: their steps fault fresh
pages in where ssdsl's do not. ``--peer-hostmem`` gives the peers' ranks the same setting, so
that a pair compares the executors alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import add_run_args  # noqa: E402
from ssdsl.runtime.launch import launch  # noqa: E402

MODEL = textwrap.dedent('''
    """The peers' benchmark model: a nanoGPT-style decoder with separate q, k, v projections."""
    import math
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    LAYERS, WIDTH, HEADS, SEQ, VOCAB = {layers}, {width}, {heads}, {seq}, {vocab}
    BATCH_SIZE = {batch}
    INPUT_DIMS = (("batch", "seq"),)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(WIDTH, WIDTH)
            self.k = nn.Linear(WIDTH, WIDTH)
            self.v = nn.Linear(WIDTH, WIDTH)
            self.c_proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            B, T, _ = x.shape
            hd = WIDTH // HEADS  # heads from the local width: a column-parallel q holds fewer
            q = self.q(x).view(B, T, -1, hd).transpose(1, 2)
            k = self.k(x).view(B, T, -1, hd).transpose(1, 2)
            v = self.v(x).view(B, T, -1, hd).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
            self.c_proj = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(WIDTH)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(WIDTH)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, WIDTH)
            self.wpe = nn.Embedding(SEQ, WIDTH)
            self.h = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(WIDTH)
            self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    def build_model():
        return GPT()

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(1000 + step)
        data = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
        return (data[:, :-1],), data[:, 1:]

    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def make_optimizer(params):
        return torch.optim.SGD(params, lr=0.01)
''')

LR = 0.01


def _orders(kind: str) -> str:
    """The ``order`` statements of one pipeline schedule over ``st`` (stdlib's, stages fixed)."""
    if kind == "gpipe":
        return """
        for s in 0..stages:
            assign st[s] to device s
            order on device s: forward st[s] mb 0..microbatches, backward st[s] mb 0..microbatches
        """
    return """
        for s in 0..stages:
            assign st[s] to device s
            let warm = min(stages - s - 1, microbatches)
            order on device s:
                forward st[s] mb 0..warm,
                interleave(forward st[s] mb warm..microbatches, backward st[s] mb 0..microbatches - warm),
                backward st[s] mb microbatches - warm..microbatches
        """


def pipeline_plan(kind: str, nproc: int, layers: int, microbatches: int) -> str:
    """A pipeline plan whose stages start at the same blocks as the torch peer's."""
    if kind == "interleaved":
        chunks = 2
        k = layers // (nproc * chunks)
        starts = ", ".join(f"h.{v * k}" for v in range(nproc * chunks))
        body = (ROOT / "stdlib_plans" / "interleaved_1f1b.ssp").read_text()
        body = body.split("stages into stages * chunks as vs", 1)[1]
        head = (f"plan bench_interleaved(stages: int = {nproc}, chunks: int = {chunks}, "
                f"microbatches: int = {microbatches})\n"
                "microbatch along batch into microbatches\n"
                f"stages {starts} as vs\n")
        return head + body
    k = layers // nproc
    starts = ", ".join(f"h.{s * k}" for s in range(nproc))
    return (f"plan bench_{kind}(stages: int = {nproc}, microbatches: int = {microbatches})\n"
            "microbatch along batch into microbatches\n"
            f"stages {starts} as st\n" + textwrap.dedent(_orders(kind)).lstrip())


def stdlib_pipeline_plan(kind: str, microbatches: int) -> str:
    """The stdlib plan of ``kind`` as a user runs it (automatic, cost-balanced stages), with
    ``microbatches`` as its default."""
    name = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved_1f1b"}[kind]
    text = (ROOT / "stdlib_plans" / f"{name}.ssp").read_text()
    head, rest = text.split("\n", 1)
    head = re.sub(r"microbatches: int = [^,)]+", f"microbatches: int = {microbatches}", head)
    return head + "\n" + rest


# -- workers: one rank each; every one returns (step times, losses) ------------------------------


# set by ``--peer-hostmem`` in the ranks' environment
PEER_HOSTMEM_VAR = "SSDSL_BENCH_PEER_HOSTMEM"


def _quiet_threads(peer: bool = True) -> None:
    torch.set_num_threads(1)
    if peer and os.environ.get(PEER_HOSTMEM_VAR):  # the peers keep host memory as ssdsl does
        from ssdsl.runtime import hostmem
        hostmem.keep()


def _timed_loop(steps: int, mf, one_step) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    times, losses = [], []
    for step in range(steps):
        inputs, target = mf.get_batch(step, mf.batch_size)
        if dist.is_initialized():
            dist.barrier()  # start every rank's clock together
        start = time.perf_counter()
        loss = one_step(inputs, target)
        times.append(time.perf_counter() - start)
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        losses.append(float(loss) if loss is not None else float("nan"))
    return times, losses


def eager_worker(model_path: str, steps: int) -> tuple[list[float], list[float]]:
    """The plain model in this process: forward, backward, SGD step."""
    from ssdsl.trace.model_file import load_model_file

    _quiet_threads()
    mf = load_model_file(model_path)
    model = mf.build(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def one_step(inputs, target):
        opt.zero_grad(set_to_none=True)
        loss = mf.loss(model(*inputs), target)
        loss.backward()
        opt.step()
        return loss.detach()
    return _timed_loop(steps, mf, one_step)


# levers that ``--off`` can turn off, each as (module, attribute, value when off): the
# runtime's, and two planning rules (one message per stage boundary value and receiving device;
# a replicated loss reported by each rank without a collective)
LEVERS = {
    "boundary": ("ssdsl.materialize.boundary", "ENABLED", False),
    "copies": ("ssdsl.materialize.copies", "ENABLED", False),
    "cut_bytes": ("ssdsl.schedule.resolve", "STAGE_SLACK", 0.0),
    "own_loss": ("ssdsl.lower.build", "OWN_LOSS", False),
    # a rank's last backward in one walk (no gradients sent before the weights')
    "send_first": ("ssdsl.lower.build", "SEND_FIRST", False),
    # that last backward walked twice (input gradients, then whole) instead of split in halves
    "split_last": ("ssdsl.lower.build", "SPLIT_LAST", False),
    # every backward of a stage that sends gradients split, each weight half run after the next
    # backward's input half (off: only the last backward split)
    "defer_w": ("ssdsl.lower.build", "DEFER_W", False),
    # a layer norm's weight-cut gradients from the input half's kernel (off: the weight half
    # computes its statistics again; read when a program is first walked)
    "early_cut": ("ssdsl.runtime.wgrad", "EARLY", False),
    "early_recv": ("ssdsl.runtime.early", "LOOKAHEAD", -1),
    "early_loss": ("ssdsl.runtime.early_loss", "ENABLED", False),
    "sender": ("ssdsl.runtime.sender", "ENABLED", False),
    # glibc's own malloc thresholds (read when a rank's trainer is made)
    "hostmem": ("ssdsl.runtime.hostmem", "ENABLED", False),
    "prebuilt": ("ssdsl.runtime.executor", "PREBUILD", False),
    "direct_op": ("ssdsl.runtime.prebuilt", "DIRECT", False),
    "bindings": ("ssdsl.runtime.prebuilt", "BINDINGS", False),
    "run_loop": ("ssdsl.runtime.executor", "RUN_LOOP", False),
    "straight": ("ssdsl.runtime.straight", "ENABLED", False),
    "prologue": ("ssdsl.runtime.prologue", "ENABLED", False),
    # each bucket's gradients through a flat buffer made once (off: made every step)
    "flat": ("ssdsl.runtime.flat", "ENABLED", False),
    # forward values no later instruction reads dropped before a backward (off: held to its end)
    "liveness": ("ssdsl.runtime.liveness", "ENABLED", False),
    # a split backward's weight half in closed form per mixing call (off: autograd per call)
    "wgrad": ("ssdsl.runtime.wgrad", "ENABLED", False),
    "overlap": ("ssdsl.lower.overlap", "PART_BYTES", 0),
    # DDP's part sizes (1 MiB, then 25 MiB) off: every part 1 MiB
    "rest_parts": ("ssdsl.lower.overlap", "REST_PART_BYTES", None),
    # sum all-reduces on gloo by pairwise exchanges below a size (off: gloo's all_reduce always)
    "exchange": ("ssdsl.runtime.exchange", "ENABLED", False),
    "shm": ("ssdsl.runtime.shm", "ENABLED", False),
}


def ssdsl_worker(model_path: str, plan: str, sets: dict, steps: int, off: tuple[str, ...] = ()
                 ) -> tuple[list[float], list[float]]:
    """One rank of ssdsl under ``plan``, through the public API (``ssdsl.parallelize``), with
    the runtime levers ``off`` turned off."""
    import importlib

    import ssdsl
    from ssdsl.trace.model_file import load_model_file

    _quiet_threads(peer=False)  # ssdsl sets its own (lever ``hostmem``)
    for lever in off:
        module, attr, value = LEVERS[lever]
        setattr(importlib.import_module(module), attr, value)
    mf = load_model_file(model_path)
    pm = ssdsl.parallelize(model_path, plan, sets=sets, optimizer="sgd", lr=LR)
    return _timed_loop(steps, mf, lambda inputs, target: pm.train_step(inputs, target))


# What a peer's rank built, kept to the end of the process (a rank leaves by ``os._exit``): torch's
# DDP reducer freed as the worker returns, after the process group was destroyed, ran the
# group's destructor with the interpreter held while a gloo thread waited for it to drop a
# tensor, and the rank hung there for good (the launcher now names such a rank).
_KEPT: list = []


def ddp_worker(model_path: str, steps: int) -> tuple[list[float], list[float]]:
    """One rank of DistributedDataParallel: each rank takes its contiguous rows of the batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file

    _quiet_threads()
    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = DistributedDataParallel(mf.build(seed=0))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        _KEPT.append((model, opt))
        share = mf.batch_size // ctx.world_size
        rows = slice(ctx.rank * share, (ctx.rank + 1) * share)

        def one_step(inputs, target):
            opt.zero_grad(set_to_none=True)
            loss = mf.loss(model(*(x[rows] for x in inputs)), target[rows])
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)  # the global batch's loss, as ssdsl reports it
            return total / ctx.world_size
        return _timed_loop(steps, mf, one_step)


def dtensor_worker(model_path: str, steps: int) -> tuple[list[float], list[float]]:
    """One rank of DTensor tensor parallelism: q/k/v and c_fc column-wise, the projections
    row-wise (Megatron's split), everything else replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file

    _quiet_threads()
    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = mf.build(seed=0)
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        _KEPT.append((model, mesh))
        for block in model.h:
            parallelize_module(block, mesh, {
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def one_step(inputs, target):
            opt.zero_grad(set_to_none=True)
            loss = mf.loss(model(*inputs), target)
            loss.backward()
            opt.step()
            return loss.detach()
        return _timed_loop(steps, mf, one_step)


class _Stage(torch.nn.Module):
    """Blocks ``lo..hi`` of the model, with the embeddings first or the head last."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.blocks = torch.nn.ModuleList(model.h[lo:hi])
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def pipe_worker(model_path: str, kind: str, microbatches: int, steps: int
                ) -> tuple[list[float], list[float]]:
    """One rank of torch.distributed.pipelining: ``kind`` is 1f1b, gpipe or interleaved."""
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file

    _quiet_threads()
    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = mf.build(seed=0)
        n, r = ctx.world_size, ctx.rank
        chunks = 2 if kind == "interleaved" else 1
        total = n * chunks
        k = len(model.h) // total
        ids = [r + c * n for c in range(chunks)]
        subs = [_Stage(model, i * k, (i + 1) * k, i == 0, i == total - 1) for i in ids]
        stages = [pp.PipelineStage(sub, i, total, torch.device("cpu")) for sub, i in zip(subs, ids)]
        if kind == "interleaved":
            schedule = pp.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=mf.loss)
        else:
            cls = pp.Schedule1F1B if kind == "1f1b" else pp.ScheduleGPipe
            schedule = cls(stages[0], microbatches, loss_fn=mf.loss)
        opt = torch.optim.SGD([p for s in subs for p in s.parameters()], lr=LR)
        _KEPT.append((schedule, stages, opt))
        holds_last = any(i == total - 1 for i in ids)

        def one_step(inputs, target):
            opt.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            kwargs = {"target": target, "losses": losses} if holds_last else {}
            args = tuple(inputs) if 0 in ids else ()
            schedule.step(*args, **kwargs)
            opt.step()
            mine = torch.stack(losses).mean() if losses else torch.zeros(())
            dist.all_reduce(mine)  # one rank holds the loss; share it as ssdsl reports it
            return mine
        return _timed_loop(steps, mf, one_step)


# -- the pairs -------------------------------------------------------------------------------------


def _pairs(args, model: str, plans: dict[str, str]) -> dict[str, dict[str, tuple]]:
    """pair -> {"ssdsl": (worker, nproc, args), "peer": (worker, nproc, args)}."""
    n, s = args.nproc, args.steps
    pairs = {
        "eager": {"ssdsl": ("bench_peers:ssdsl_worker", 1, (model, "dp", {}, s)),
                  "peer": ("bench_peers:eager_worker", 1, (model, s))},
        "dp": {"ssdsl": ("bench_peers:ssdsl_worker", n, (model, "dp", {}, s)),
               "peer": ("bench_peers:ddp_worker", n, (model, s))},
        "tp": {"ssdsl": ("bench_peers:ssdsl_worker", n, (model, "megatron_tp", {}, s)),
               "peer": ("bench_peers:dtensor_worker", n, (model, s))},
    }
    for kind in ("1f1b", "gpipe", "interleaved"):
        pairs[kind] = {"ssdsl": ("bench_peers:ssdsl_worker", n, (model, plans[kind], {}, s)),
                       "peer": ("bench_peers:pipe_worker", n, (model, kind, args.microbatches, s))}
    for sides in pairs.values():  # the same ssdsl launch with each lever off, beside it
        worker, nproc, wargs = sides["ssdsl"]
        for lever in args.off:
            sides[f"ssdsl-no-{lever}"] = (worker, nproc, (*wargs, (lever,)))
    return {k: v for k, v in pairs.items() if k in args.only}


def _one_launch(worker: str, nproc: int, wargs: tuple, warmup: int) -> tuple[float, list[float]]:
    per_rank = launch(worker, nproc=nproc, args=wargs, timeout_s=900)
    slowest = [max(ts) for ts in zip(*(times for times, _ in per_rank))]
    losses = [statistics.fmean(step) for step in zip(*(ls for _, ls in per_rank))
              if all(x == x for x in step)] or per_rank[0][1]
    return statistics.median(slowest[warmup:]), losses


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="*", default=["eager", "dp", "tp", "1f1b", "gpipe",
                                                 "interleaved"])
    p.add_argument("--off", nargs="*", default=[], choices=sorted(LEVERS),
                   help="also run ssdsl with each of these levers off (round-robin); "
                   "'lever' gives ssdsl / ssdsl-without-it")
    p.add_argument("--peer-hostmem", action="store_true",
                   help="the peers' ranks keep freed host memory as ssdsl's do "
                   "(ssdsl.runtime.hostmem): the executors alone compared")
    args = p.parse_args(argv)
    if args.peer_hostmem:
        os.environ[PEER_HOSTMEM_VAR] = "1"
    if args.layers % (2 * args.nproc):
        p.error("--layers must be a multiple of 2 * --nproc (interleaved uses 2 chunks a rank)")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank on both sides
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "peers_gpt.py"
        model.write_text(MODEL.format(layers=args.layers, width=args.width, heads=args.heads,
                                      seq=args.seq, vocab=args.vocab, batch=args.batch_size))
        plans = {}
        for kind in ("1f1b", "gpipe", "interleaved"):
            path = Path(tmp) / f"bench_{kind}.ssp"
            path.write_text(pipeline_plan(kind, args.nproc, args.layers, args.microbatches))
            plans[kind] = str(path)
        pairs = _pairs(args, str(model), plans)
        figures = {pair: {side: [] for side in sides} for pair, sides in pairs.items()}
        losses: dict[str, dict[str, list[float]]] = {pair: {} for pair in pairs}
        for _ in range(args.rounds):
            for pair, sides in pairs.items():
                for side, (worker, nproc, wargs) in sides.items():
                    step_s, ls = _one_launch(worker, nproc, wargs, args.warmup)
                    figures[pair][side].append(step_s)
                    losses[pair][side] = ls
    results = {}
    for pair, sides in figures.items():
        ssdsl_s, peer_s = (statistics.median(sides[k]) for k in ("ssdsl", "peer"))
        a, b = losses[pair]["ssdsl"], losses[pair]["peer"]
        agreement = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
        results[pair] = {"ssdsl_step_s": ssdsl_s, "peer_step_s": peer_s,
                         "ratio": ssdsl_s / peer_s, "loss_agreement": agreement,
                         "rounds": sides}
        for lever in args.off:
            without = statistics.median(sides[f"ssdsl-no-{lever}"])
            results[pair][f"lever_{lever}"] = ssdsl_s / without
            results[pair][f"ratio_without_{lever}"] = without / peer_s
    report = {"config": vars(args), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
              f"torch {torch.__version__}, gloo, 1 thread per rank", "pairs": results}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
