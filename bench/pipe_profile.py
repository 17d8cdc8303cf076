"""Where a pipeline step spends its time, per rank, on both sides of bench_peers' pipeline pairs.

    python bench/pipe_profile.py [--nproc 2] [--kind 1f1b] [--steps 12] [--warmup 4] [--rounds 2]

ssdsl's side: every instruction the executor visits is timed (``Runner.visit`` and the walk of
its waits; the timed runner walks its program instruction by instruction, without the
straight-line code of ``ssdsl.runtime.straight``, so its own figures are a little higher), and the time spent inside torch.distributed's blocking calls (``Work.wait``, ``recv``,
collectives) is counted apart as ``wait:KIND``; posting an ``isend``/``irecv`` as ``post:...``;
the main thread's CPU time per kind as ``cpu:KIND``. torch's side: ``forward_one_chunk``,
``backward_one_chunk``, the p2p posts and waits, the optimizer and the loss all-reduce, with
their CPU time likewise. Both: the process's CPU time (``cpu``, communication threads included),
the main thread's (``cpu_main``) and cyclic GC (``gcN``). Prints, per round, side and rank, the
median over the steps after ``--warmup`` of each bucket (ms; ``n:`` counts) and the time line of
the median step (``line``: unit begins/ends and waits, ms from the first rank's start on the
ranks' shared monotonic clock). A diagnostic: the time stamps cost a little themselves (a few
microseconds per instruction); CPU times move less with a loaded machine than wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers as bp  # noqa: E402
from ssdsl.runtime.launch import launch  # noqa: E402

_WAIT = [0.0]  # seconds spent blocked in torch.distributed since the last look
_POSTS: dict[str, float] = defaultdict(float)  # seconds spent posting isend / irecv


def _timed(fn):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _WAIT[0] += time.perf_counter() - t
    return run


def _patch_dist() -> None:
    """Count the time spent in torch.distributed's blocking calls."""
    import torch.distributed as dist
    for name in ("recv", "all_reduce", "barrier_", "all_gather", "reduce_scatter"):
        if hasattr(dist, name):
            setattr(dist, name, _timed(getattr(dist, name)))
    orig_irecv, orig_isend = dist.irecv, dist.isend

    class _W:
        def __init__(self, w):
            self.w = w

        def wait(self, *a, **k):
            t = time.perf_counter()
            try:
                return self.w.wait(*a, **k)
            finally:
                _WAIT[0] += time.perf_counter() - t

        def is_completed(self):
            return self.w.is_completed()

    def posting(name, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return _W(fn(*a, **k))
            finally:
                _POSTS[name] += time.perf_counter() - t
                _POSTS["n:" + name] += 1
        return run

    dist.irecv = posting("irecv", orig_irecv)
    dist.isend = posting("isend", orig_isend)


def _gc_timer(buckets: dict) -> None:
    """Count each generation's cyclic collections and the time they take into ``buckets``."""
    import gc
    began = [0.0]

    def cb(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            g = info["generation"]
            buckets[f"gc{g}"] += time.perf_counter() - began[0]
            buckets[f"n:gc{g}"] += 1
    gc.callbacks.append(cb)


def ssdsl_prof(model_path: str, plan: str, steps: int) -> list[dict]:
    import ssdsl
    from ssdsl.runtime import executor
    from ssdsl.trace.model_file import load_model_file

    bp._quiet_threads()
    _patch_dist()
    import torch.distributed as dist
    mf = load_model_file(model_path)
    pm = ssdsl.parallelize(model_path, plan, optimizer="sgd", lr=bp.LR)
    runner = pm._program.runner
    buckets: dict[str, float] = defaultdict(float)
    orig_visit = executor.Runner.visit

    def visit(self, ins):
        c = time.thread_time()
        t = time.perf_counter()
        w0 = _WAIT[0]
        waits = orig_visit(self, ins)
        if waits is not None:
            for _ in waits:
                raise RuntimeError("never waits")
        dt = time.perf_counter() - t
        buckets["cpu:" + (ins.kind if ins.kind != "comm" else
                          "comm_bwd" if ins.backward else "comm_fwd")] += time.thread_time() - c
        wait = _WAIT[0] - w0
        kind = ins.kind
        if kind == "comm":
            kind = "comm_bwd" if ins.backward else "comm_fwd"
        if kind == "call":
            kind = "call"
        buckets[kind] += dt - wait
        if ins.kind in ("begin", "end"):
            line.append((ins.kind[0] + ins.unit, t, t + dt))
        elif ins.kind in ("comm", "loss_sum", "step", "wait_sends") and wait > 2e-5:
            line.append(("wait_" + kind, t, t + dt))
        buckets["wait:" + kind] += wait
        buckets["n:" + kind] += 1
        return None

    # a class of its own whose visit is timed: ``Runner.run`` walks such a runner instruction by
    # instruction (a visit set on the instance alone would be bypassed by the straight-line
    # code, and nothing would be timed)
    runner.__class__ = type("Profiled" + type(runner).__name__, (type(runner),),
                            {"visit": visit})
    _gc_timer(buckets)
    line: list = []
    t_step = [0.0]
    out = []
    for step in range(steps):
        inputs, target = mf.get_batch(step, mf.batch_size)
        dist.barrier()
        buckets.clear()
        line.clear()
        _POSTS.clear()
        c = time.process_time()
        cm = time.thread_time()
        t = t_step[0] = time.perf_counter()
        pm.train_step(inputs, target)
        total = time.perf_counter() - t
        buckets["cpu"] = time.process_time() - c
        buckets["cpu_main"] = time.thread_time() - cm
        row = dict(buckets)
        row["step_total"] = total
        row.update({(k[:2] + "post:" + k[2:]) if k.startswith("n:") else "post:" + k: v
                    for k, v in _POSTS.items()})
        row["in_instructions"] = sum(v for k, v in buckets.items()
                                    if not k.startswith(("n:", "cpu", "gc")))
        row["line"] = list(line)
        row["t0"] = t
        out.append(row)
    return out


def torch_prof(model_path: str, kind: str, microbatches: int, steps: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed import pipelining as pp
    from torch.distributed.pipelining import schedules

    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file

    bp._quiet_threads()
    buckets: dict[str, float] = defaultdict(float)

    line: list = []
    t_step = [0.0]

    def timed(name, fn):
        def run(*a, **k):
            t = time.perf_counter()
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                buckets["cpu:" + name] += time.thread_time() - c
                buckets[name] += t1 - t
                buckets["n:" + name] += 1
                if name in ("forward", "backward") or t1 - t > 2e-5:
                    mb = a[0] if a and isinstance(a[0], int) else ""
                    line.append((f"{name}{mb}", t, t1))
        return run

    _gc_timer(buckets)
    schedules._wait_batch_p2p = timed("wait:p2p", schedules._wait_batch_p2p)
    schedules._batch_p2p = timed("post:p2p", schedules._batch_p2p)
    mf = load_model_file(model_path)
    with distributed() as ctx:
        model = mf.build(seed=0)
        n, r = ctx.world_size, ctx.rank
        chunks = 2 if kind == "interleaved" else 1
        total = n * chunks
        k = len(model.h) // total
        ids = [r + c * n for c in range(chunks)]
        subs = [bp._Stage(model, i * k, (i + 1) * k, i == 0, i == total - 1) for i in ids]
        stages = [pp.PipelineStage(sub, i, total, torch.device("cpu")) for sub, i in zip(subs, ids)]
        for st in stages:
            st.forward_one_chunk = timed("forward", st.forward_one_chunk)
            st.backward_one_chunk = timed("backward", st.backward_one_chunk)
            st.perform_reduce_grad = timed("reduce_grad", st.perform_reduce_grad)
        if kind == "interleaved":
            schedule = pp.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=mf.loss)
        else:
            cls = pp.Schedule1F1B if kind == "1f1b" else pp.ScheduleGPipe
            schedule = cls(stages[0], microbatches, loss_fn=mf.loss)
        opt = torch.optim.SGD([p for s in subs for p in s.parameters()], lr=bp.LR)
        holds_last = any(i == total - 1 for i in ids)
        out = []
        for step in range(steps):
            inputs, target = mf.get_batch(step, mf.batch_size)
            dist.barrier()
            buckets.clear()
            line.clear()
            c0 = time.process_time()
            cm = time.thread_time()
            t0 = t_step[0] = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            kwargs = {"target": target, "losses": losses} if holds_last else {}
            args = tuple(inputs) if 0 in ids else ()
            t = time.perf_counter()
            schedule.step(*args, **kwargs)
            buckets["schedule.step"] += time.perf_counter() - t
            t = time.perf_counter()
            opt.step()
            buckets["opt"] += time.perf_counter() - t
            t = time.perf_counter()
            mine = torch.stack(losses).mean() if losses else torch.zeros(())
            dist.all_reduce(mine)
            float(mine)
            buckets["wait:loss_allreduce"] += time.perf_counter() - t
            buckets["cpu"] = time.process_time() - c0
            buckets["cpu_main"] = time.thread_time() - cm
            row = dict(buckets)
            row["step_total"] = time.perf_counter() - t0
            row["line"] = list(line)
            row["t0"] = t0
            out.append(row)
        return out


def _summary(per_rank: list[list[dict]], warmup: int) -> list[dict]:
    """Per rank: the median of each bucket over the steps after ``warmup``, and the time line of
    the step whose slowest rank is the median one (ms from the first rank's start; the ranks
    share one monotonic clock)."""
    res = []
    slowest = [max(r[i]["step_total"] for r in per_rank) for i in range(len(per_rank[0]))]
    order = sorted(range(warmup, len(slowest)), key=slowest.__getitem__)
    mid = order[len(order) // 2]
    origin = min(r[mid]["t0"] for r in per_rank)
    for all_rows in per_rank:
        rows = all_rows[warmup:]
        keys = sorted({k for r in rows for k in r if k not in ("line", "t0")})
        res.append({k: round(statistics.median(r.get(k, 0.0) for r in rows)
                             * (1 if k.startswith("n:") else 1000), 3) for k in keys})
        res[-1]["line"] = [(n, round((a - origin) * 1000, 2), round((b - origin) * 1000, 2))
                           for n, a, b in all_rows[mid]["line"]]
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--kind", default="1f1b")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "peers_gpt.py"
        model.write_text(bp.MODEL.format(layers=args.layers, width=128, heads=4, seq=64,
                                         vocab=512, batch=16))
        plan = Path(tmp) / "plan.ssp"
        plan.write_text(bp.pipeline_plan(args.kind, args.nproc, args.layers, args.microbatches))
        for rnd in range(args.rounds):
            s = launch("pipe_profile:ssdsl_prof", nproc=args.nproc,
                       args=(str(model), str(plan), args.steps), timeout_s=900)
            t = launch("pipe_profile:torch_prof", nproc=args.nproc,
                       args=(str(model), args.kind, args.microbatches, args.steps),
                       timeout_s=900)
            print(json.dumps({"round": rnd, "ssdsl": _summary(s, args.warmup),
                              "torch": _summary(t, args.warmup)}, indent=1))


if __name__ == "__main__":
    main()


def ssdsl_cprofile(model_path: str, plan: str, steps: int, out: str) -> None:
    """cProfile of ``steps`` steps of ssdsl (after 3 unprofiled), one file per rank."""
    import cProfile

    import torch.distributed as dist

    import ssdsl
    from ssdsl.trace.model_file import load_model_file

    bp._quiet_threads()
    mf = load_model_file(model_path)
    pm = ssdsl.parallelize(model_path, plan, optimizer="sgd", lr=bp.LR)
    prof = cProfile.Profile()
    for step in range(steps + 3):
        inputs, target = mf.get_batch(step, mf.batch_size)
        dist.barrier()
        if step == 3:
            prof.enable()
        pm.train_step(inputs, target)
    prof.disable()
    prof.dump_stats(f"{out}.{dist.get_rank()}")
