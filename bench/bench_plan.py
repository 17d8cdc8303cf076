"""Planning time at scale: a GPT traced on ``meta``, a plan applied, communication derived, code
generated for every rank (DESIGN §8). Prints the time of each phase as JSON.

    .venv/bin/python bench/bench_plan.py --layers 24 --hidden 1024 --heads 16 --plan megatron_tp --world 8
    .venv/bin/python bench/bench_plan.py --plan dp_tp_1f1b --set dp=2 --set tp=2 --world 8

Times are wall-clock seconds; ``cpu`` gives the process's CPU seconds of each phase (on a shared
machine, what another process's load does not inflate). Codegen writes every rank's file as it is
made (into ``-o DIR``, or a temporary folder it removes), so the peak memory is the plan's, not the
files'. It is skipped for plans it refuses and reported as such.

Codegen lowers each rank class once and stamps the other ranks' programs from it
(``ssdsl.lower.classes``), so ``--ranks N`` (N evenly spaced ranks, mostly the first of their
class) overestimates the whole world's codegen. ``--check`` also lowers every rank's program
before codegen and checks them all (``check_programs_s``), as ``ssdsl compile`` does.
Codegen writes the files from ``--jobs`` forked processes (default: the cores this process may
use, as ``ssdsl compile``); its ``cpu`` figure adds theirs, so with 2 jobs codegen's wall time is
about half its CPU time. ``--jobs 1`` is the one-process figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import tempfile
import time

import torch

from bench_trace import _gpt_module
from ssdsl.elaborate import elaborate_file
from ssdsl.errors import SsdslError
from ssdsl.gcpause import gc_paused
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace.export import _input_seeds, _TrainingForward, graph_from_export
from ssdsl.trace.model_file import ModelFile, default_loss, default_optimizer


def meta_gpt_graph(layers: int, heads: int, hidden: int, seq: int, vocab: int, batch: int):
    """examples/gpt.py at this size (its LM head tied to the token embedding), traced on meta."""
    with torch.device("meta"):
        model = _gpt_module().build_gpt(n_layer=layers, n_head=heads, n_embd=hidden,
                                        block_size=seq, vocab=vocab)
        idx = torch.randint(0, vocab, (batch, seq + 1), device="meta")
        data = (idx[:, :-1], idx[:, 1:])
        ep = torch.export.export(_TrainingForward(model, default_loss), data, strict=False)
        mf = ModelFile(path="gpt", build_model=lambda: model, get_batch_fn=lambda s, b: data,
                       loss=default_loss, make_optimizer=default_optimizer, batch_size=batch,
                       input_dims=(("batch", "seq"),), has_optimizer=False)
        return graph_from_export(ep, seeds=_input_seeds(mf, ep, 1), model=model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--plan", default="megatron_tp")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="write the files of N evenly spaced ranks only, and estimate codegen "
                   "for the world from them (codegen_est_s, total_est_s)")
    p.add_argument("--check", action="store_true",
                   help="lower and check every rank's program first (as ssdsl compile does)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes that write the files, as `ssdsl compile --jobs` (default: the "
                   "cores this process may use)")
    p.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="keep the per-rank files in DIR (default: a temporary folder, removed)")
    a = p.parse_args()
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}  # this process's CPU time: what a loaded machine does not inflate

    # one plan per process, as ``ssdsl compile``: what each phase makes lives to the end, and the
    # collector never scans it again (``ssdsl.gcpause``)
    t0, c0 = time.perf_counter(), time.process_time()
    paused = functools.partial(gc_paused, keep=True)
    with paused():
        graph = meta_gpt_graph(a.layers, a.heads, a.hidden, a.seq, a.vocab, a.batch)
    times["trace_s"] = time.perf_counter() - t0
    cpu["trace_s"] = time.process_time() - c0

    t0, c0 = time.perf_counter(), time.process_time()
    plan = elaborate_file(a.plan, world=a.world, sets=dict(s.split("=", 1) for s in a.set))
    times["elaborate_s"] = time.perf_counter() - t0
    cpu["elaborate_s"] = time.process_time() - c0

    t0, c0 = time.perf_counter(), time.process_time()
    with paused():
        t, lowered = schedule_plan(graph, plan)
    times["transform_schedule_check_s"] = time.perf_counter() - t0
    cpu["transform_schedule_check_s"] = time.process_time() - c0

    from ssdsl.materialize.program import materialize
    t0, c0 = time.perf_counter(), time.process_time()
    with paused():
        m = materialize(t, dtype=torch.float32, schedule=lowered)
    times["materialize_s"] = time.perf_counter() - t0
    cpu["materialize_s"] = time.process_time() - c0

    programs: dict[int, object] = {}
    if a.check:
        from ssdsl.check import check_programs
        from ssdsl.lower import lower_plan
        t0, c0 = time.perf_counter(), time.process_time()
        with paused():
            programs = dict(enumerate(lower_plan(m).programs))
            check_programs(tuple(programs.values()), m=m)
        times["lower_check_programs_s"] = time.perf_counter() - t0
        cpu["lower_check_programs_s"] = time.process_time() - c0

    from ssdsl.codegen import Provenance, default_jobs, generate_rank, rank_order, write_programs
    t0, c0 = time.perf_counter(), time.process_time()
    kids0 = sum(getattr(resource.getrusage(resource.RUSAGE_CHILDREN), f)
                for f in ("ru_utime", "ru_stime"))
    codegen = "ok"
    prov = Provenance.of("gpt.py", plan)
    with paused(), tempfile.TemporaryDirectory(prefix="bench_plan.") as tmp:
        out = a.output or tmp
        try:  # each file written as it is made (the folder holds them, not this process)
            ranks = range(0, a.world, max(1, a.world // (a.ranks or a.world)))
            paths = write_programs(out, {f"rank{r}.py": functools.partial(
                generate_rank, m, r, prov, programs.get(r)) for r in ranks},
                jobs=a.jobs or default_jobs(), order=rank_order(m))
            size = sum(p.stat().st_size for p in paths) / 2**20
            codegen = (f"{len(paths)} files, {size:.1f} MiB" if len(ranks) == a.world else
                       f"{len(paths)} of {a.world} files, {size:.1f} MiB (all: "
                       f"~{size * a.world / len(ranks):.0f} MiB)") + (f" in {out}" if a.output else "")
        except SsdslError as err:
            codegen, ranks = f"skipped: {err.message}", range(a.world)
        times["codegen_s"] = time.perf_counter() - t0
        # the forked writers' CPU too (``--jobs``): the children this process waited for
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu["codegen_s"] = time.process_time() - c0 + kids.ru_utime + kids.ru_stime - kids0
    times["total_s"] = sum(times.values())
    cpu["total_s"] = sum(cpu.values())
    if len(ranks) < a.world:
        times["codegen_est_s"] = times["codegen_s"] * a.world / len(ranks)
        times["total_est_s"] = times["total_s"] - times["codegen_s"] + times["codegen_est_s"]
        cpu["codegen_est_s"] = cpu["codegen_s"] * a.world / len(ranks)
        cpu["total_est_s"] = cpu["total_s"] - cpu["codegen_s"] + cpu["codegen_est_s"]
    print(json.dumps({"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq,
                      "plan": a.plan, "world": a.world, "sets": a.set, "ops": len(graph.ops),
                      "parts": sum(len(v) for v in t.parts.values()), "edges": len(m.edges),
                      "codegen": codegen, **{k: round(v, 2) for k, v in times.items()},
                      "cpu": {k: round(v, 2) for k, v in cpu.items()},
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024},
                     indent=1))


if __name__ == "__main__":
    main()
