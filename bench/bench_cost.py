"""Calibrate the cost model on this machine, then check what it predicts against measured runs.

    python bench/bench_cost.py measure      # writes ssdsl/cost/cpu.json (the `cpu` profile)
    python bench/bench_cost.py calibrate    # predicted vs measured gloo step times, 2 ranks
    python bench/bench_cost.py ops MODEL    # per operator kind: predicted vs profiled, 1 rank

``measure`` times, on 2 gloo processes at once (a step runs its ranks together on the machine's
cores), each with the threads a rank gets under ``ssdsl run --nproc 2``: float32/float64 matmul
FLOP/s (a large square product, the peak; and the products of a training step, a stack of linear
layers' forward and backward at four widths: ``matmul_curve``), a fused attention's FLOP/s
(forward and backward, at four sequence lengths: ``attention_curve``) and whether a causal mask
halves its time, the share of an all-reduce's time that compute beside it hides
(``comm_overlap``), memory bandwidth (a large copy), the fixed cost of a small operator (eager, and the ssdsl
executor's own), and the latency and bandwidth of all-reduce and send/recv, fitted together to
the alpha-beta model (a message: alpha + n / beta; an all-reduce of n bytes over 2 ranks as the
runtime runs it: up to ``ssdsl.runtime.exchange``'s bound one round of exchanges, a send and a
receive at once, alpha_x + n / beta, with its own fixed cost alpha_x (``exchange_latency``);
gloo's ring, 2 alpha + n / beta, beyond; the profile's ``exchange_bytes`` is that bound, so
``ssdsl cost`` prices the sums the runtime exchanges as exchanges). The collectives are timed
as a step meets them, each call after a compute gap on both ranks (what the loop with the call
takes beyond the loop without it); back to back, as most collective benchmarks time them,
gloo's latency is several times lower, and both fits are printed. The latency also has a floor
from the executor itself: what one all-reduce instruction adds to an ssdsl step
(``executor_collective``: a chain of column/row-parallel blocks against the same chain under
``dp``, both run with ``ssdsl run --nproc 2``); the profile's alpha is the larger of the fit
and half that instruction, its alpha_x the larger of its fit and the whole instruction (one
round). Per quantity the profile keeps the slowest rank's
figure.
``calibrate`` runs ``ssdsl run --json --nproc 2`` for each model and plan and compares the median
step time (of each run's steps after the first, median over repeats, slowest rank) with
``ssdsl cost --device cpu`` (the profile is measured again right before each case, as the load of a shared machine
changes within minutes; runs and profiles are kept in ``bench/cost_measured.json``, and
``--reuse`` predicts again from them without running). The machine is shared: every figure is a median of repeats.
``ops`` says where a step's prediction is off: the plain model's forward and backward in one
process (the threads of one rank), profiled by ``torch.profiler``, per ATen operator kind
forward and per autograd node backward, beside the cost model's time for each kind (the
``dp`` plan on one device, ``ssdsl.cost.work.operator_times``). The profile's per-operator
overhead is the ssdsl executor's (``op_overhead``, ``view_overhead``), so a plain model's small
operators and views profile below their prediction; a run's executor pays it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROFILE = Path(os.environ.get("SSDSL_CPU_PROFILE") or ROOT / "ssdsl" / "cost" / "cpu.json")
# "median" (what a run under the current load sees) or "min" (the least-disturbed repeat: on a
# shared machine, the closest to the machine's own speed), for micro-benchmarks and runs alike
STAT = os.environ.get("SSDSL_BENCH_STAT", "median")
RANKS = 2


def _threads() -> int:
    return max(1, (os.cpu_count() or 1) // RANKS)


def _median_time(fn, *, repeats: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return min(times) if STAT == "min" else statistics.median(times)


def matmul_rate(dtype: torch.dtype, n: int, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _median_time(lambda: torch.mm(a, b), repeats=repeats)


def copy_bandwidth(mb: int, repeats: int) -> float:
    a = torch.randn(mb * 2 ** 20 // 4)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _median_time(lambda: b.copy_(a), repeats=repeats)


STEP_WIDTHS = (128, 256, 512, 1024)  # a linear stack's widths: products of 0.5-17 GFLOP
SEQ_LENS = (64, 128, 256, 512)


def step_matmul_rates(repeats: int, tokens: int = 2048) -> list[tuple[float, float]]:
    """``(FLOPs of one product, FLOP/s)`` of matrix products as a training step runs them: the
    forward and backward of a stack of linear layers (``d -> 4d -> d``, with bias, fresh
    outputs, autograd keeping what it keeps), FLOPs counted as ``ssdsl.cost.ops`` counts them
    (``2 M N K`` forward, twice that backward), at each of ``STEP_WIDTHS``. Below a large
    square product's rate, and the more so the smaller the product."""
    points = []
    for d in STEP_WIDTHS:
        net = torch.nn.Sequential(*[torch.nn.Linear(*io) for _ in range(2)
                                    for io in ((d, 4 * d), (4 * d, d))])
        x = torch.randn(tokens, d, requires_grad=True)
        product = 2.0 * tokens * d * 4 * d
        flops = 4 * 3 * product
        points.append((product, flops / _median_time(lambda: net(x).sum().backward(),
                                                     repeats=repeats)))
    return points


def attention_rates(repeats: int) -> tuple[list[tuple[float, float]], float]:
    """(``(score elements per head L S, FLOP/s)`` of a fused attention's forward and backward at
    each of ``SEQ_LENS`` (head dim 64; fewer heads for longer sequences), counted as
    ``ssdsl.cost.ops`` counts them: ``4 B H L S E`` forward, twice that plus one more ``Q K^T``
    backward; the causal step's time over the unmasked one's at 256 positions: near 1 when the
    kernel does not skip the masked half)."""
    import torch.nn.functional as F
    points, ratio = [], 1.0
    for seq, heads in zip(SEQ_LENS, (256, 128, 64, 16)):
        shape = (heads // 8, 8, seq, 64)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        flops = 4.0 * heads * seq * seq * 64
        both = flops + 2 * flops + flops / 2

        def step(causal: bool) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

        full = _median_time(lambda: step(False), repeats=repeats)
        points.append((float(seq * seq), both / full))
        if seq == 256:
            ratio = _median_time(lambda: step(True), repeats=repeats) / full
    return points, ratio


def op_overheads(repeats: int) -> tuple[float, float]:
    """(seconds per small op, forward and backward averaged; seconds per view)."""
    n = 200
    x = torch.randn(4, 4, requires_grad=True)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    fwd = _median_time(chain, repeats=repeats) / n
    both = _median_time(lambda: chain().sum().backward(), repeats=repeats) / n
    views = _median_time(lambda: [x.view(16).view(4, 4) for _ in range(n // 2)],
                         repeats=repeats) / n
    return both / 2 if both > fwd else fwd, views + 0 * fwd


CHAIN = """
import torch, torch.nn as nn
BATCH_SIZE = 4
INPUT_DIMS = (("batch", "features"),)
LAYERS = {layers}
def build_model():
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(8, 8), nn.GELU())])
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 8, (batch_size,), generator=g)
"""


def executor_overhead(repeats: int) -> float:
    """Seconds per operator (forward and backward averaged) of the ssdsl executor itself: the
    step time of a chain of tiny layers, fitted linearly in the number of operators."""
    from ssdsl.runtime.executor import RankProgram
    from ssdsl.runtime.job import JobSpec, plan_job
    from ssdsl.runtime.train import OptimizerSpec
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in (4, 16, 32):
            path = Path(tmp) / f"chain{layers}.py"
            path.write_text(CHAIN.format(layers=layers))
            mf, m, model = plan_job(JobSpec(model=str(path), plan="dp"), 1)
            prog = RankProgram(m, 0, mf, model, dtype=torch.float32,
                               optimizer=OptimizerSpec("sgd"), groups=None)
            ops = len(m.transformed.graph.ops)
            points.append((ops, _median_time(lambda: prog.step(0, None), repeats=repeats)))
    # least-squares slope of step time over operator count
    mean_n = statistics.fmean(n for n, _ in points)
    mean_t = statistics.fmean(t for _, t in points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / \
        sum((n - mean_n) ** 2 for n, _ in points)
    return slope / 2


CHAIN_TP = """
import torch, torch.nn as nn
BATCH_SIZE = 8
INPUT_DIMS = (("batch", "features"),)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(),
                                                    nn.Linear(32, 16)) for _ in range({layers})])
    def forward(self, x):
        return self.layers(x)
def build_model():
    return Net()
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 16, (batch_size,), generator=g)
"""
CHAIN_TP_PLAN = """plan chain_tp()
partition layers.* except layers.*.2 along out into world
partition layers.*.2 along in into world
replicate rest into world
assign each part i to device i
"""


def executor_collective(steps: int = 12) -> float:
    """Seconds one all-reduce instruction of the ssdsl executor costs inside a step, on 2 ranks
    that compute between them: a chain of tiny blocks, each a column- then row-parallel pair
    (one all-reduce in forward, one in backward), run with ``ssdsl run --nproc 2`` at 2, 8 and
    16 blocks; the growth of the step time per block beyond the same chain under ``dp`` (the
    same operators on the same 2 busy ranks, no per-block communication), per all-reduce."""
    slopes = {}
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "chain_tp.ssp"
        plan.write_text(CHAIN_TP_PLAN)
        for name, which in (("tp", str(plan)), ("dp", "dp")):
            points = []
            for layers in (2, 8, 16):
                model = Path(tmp) / f"chain{layers}.py"
                model.write_text(CHAIN_TP.replace("{layers}", str(layers)))
                points.append((layers, _measured(str(model), which, steps, "--no-verify")))
            mean_n = statistics.fmean(n for n, _ in points)
            mean_t = statistics.fmean(t for _, t in points)
            slopes[name] = sum((n - mean_n) * (t - mean_t) for n, t in points) / \
                sum((n - mean_n) ** 2 for n, _ in points)
    return max(slopes["tp"] - slopes["dp"], 0.0) / 2


def _gap(k: int) -> None:
    """A compute gap between two calls: ``k`` small products, as a step's operators run."""
    a = _GAP_A
    for _ in range(k):
        torch.mm(a, a)


_GAP_A = torch.randn(64, 64)
GAPS = (4, 16, 64)  # about 15, 60 and 250 us of compute between two calls
COMM_SIZES = [4, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _comm_once(kind: str, buf: torch.Tensor, rank: int) -> None:
    import torch.distributed as dist

    from ssdsl.runtime import exchange
    if kind == "all_reduce":  # as the runtime sums: by exchanges where they run, else gloo's
        exchange.all_reduce(buf)
    elif rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _comm_rows(rank: int, repeats: int, *, in_step: bool) -> list[tuple[str, int, float]]:
    """(kind, bytes, seconds per call). Back to back (``in_step`` false), or each call after a
    compute gap on both ranks, as inside a step: there a call costs what the loop with it takes
    beyond the same loop without it (a rank that computed has to be woken; its peer waits)."""
    import torch.distributed as dist
    rows = []
    for n in COMM_SIZES:
        buf = torch.zeros(max(1, n // 4))
        for kind in ("all_reduce", "p2p"):
            per_call = 2 if kind == "p2p" else 1
            if not in_step:
                dist.barrier()
                t = _median_time(lambda: _comm_once(kind, buf, rank), repeats=repeats)
                rows.append((kind, buf.numel() * 4, t / per_call))
                continue
            inner = 8 if n <= (256 << 10) else 2
            deltas = []
            for k in GAPS:
                dist.barrier()
                plain = _median_time(lambda: _gap(k), repeats=repeats, inner=inner)
                dist.barrier()
                both = _median_time(lambda: (_gap(k), _comm_once(kind, buf, rank)),
                                    repeats=repeats, inner=inner)
                deltas.append(max(both - plain, 1e-7))
            rows.append((kind, buf.numel() * 4, statistics.median(deltas) / per_call))
    return rows


def comm_overlap(repeats: int, nbytes: int = 4 << 20) -> float:
    """The share of an all-reduce's time hidden by compute running beside it, as gradient
    buckets run beside the last backward: an asynchronous all-reduce of ``nbytes`` started
    before a run of products about as long, waited for after them, against the two one after
    the other (``(compute + all-reduce - both) / all-reduce``, clamped to [0, 1])."""
    import torch.distributed as dist

    from ssdsl.runtime import exchange
    buf = torch.zeros(nbytes // 4)
    comm = _median_time(lambda: exchange.all_reduce(buf), repeats=repeats)
    a = torch.randn(256, 256)
    k = 1

    def products() -> None:
        for _ in range(k):
            torch.mm(a, a)

    while _median_time(products, repeats=3) < comm and k < 4096:
        k *= 2
    dist.barrier()
    compute = _median_time(products, repeats=repeats)

    def both() -> None:
        work = exchange.all_reduce(buf, async_op=True)
        products()
        work.wait()

    dist.barrier()
    together = _median_time(both, repeats=repeats)
    return min(1.0, max(0.0, (compute + comm - together) / comm))


def _profile_worker(rank: int, port: int, repeats: int, out: str) -> None:
    """Every micro-benchmark, on ``RANKS`` processes at once: a step runs its ranks together on
    the machine's cores, so the rates are measured with the other rank busy beside this one."""
    import torch.distributed as dist
    torch.set_num_threads(_threads())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    res: dict[str, object] = {}

    def together(name: str, fn) -> None:
        dist.barrier()
        res[name] = fn()

    together("f32", lambda: max(matmul_rate(torch.float32, n, repeats) for n in (256, 512, 1024)))
    together("f64", lambda: max(matmul_rate(torch.float64, n, repeats) for n in (256, 512)))
    together("bw", lambda: copy_bandwidth(64, repeats))
    together("step_mm", lambda: step_matmul_rates(repeats))
    together("attn", lambda: attention_rates(repeats))
    together("op", lambda: op_overheads(repeats))
    together("executor", lambda: executor_overhead(repeats))
    together("idle", lambda: _comm_rows(rank, repeats, in_step=False))
    together("in_step", lambda: _comm_rows(rank, repeats, in_step=True))
    together("overlap", lambda: comm_overlap(repeats))
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    dist.destroy_process_group()


LARGE = 256 << 10  # messages from this size on set the bandwidth


def _exchanged(kind: str, n: int) -> int:
    """The rounds of exchanges (``ssdsl.runtime.exchange``) an all-reduce of ``n`` bytes over
    ``RANKS`` ranks runs as, or 0 where it is gloo's (or no all-reduce)."""
    from ssdsl.cost.collectives import exchange_rounds
    from ssdsl.runtime import exchange
    rounds = exchange_rounds(RANKS)
    ok = kind == "all_reduce" and exchange.ENABLED and n * rounds <= exchange.MAX_BYTES
    return rounds if ok else 0


def _exchange_alpha(rows: list, beta: float) -> float | None:
    """The fixed cost of one round of exchanges: over the all-reduce rows that ran as
    exchanges, the median of (seconds - bytes / beta) per round; None where none did."""
    per_round = [(t - n / beta) / r for k, n, t in rows if (r := _exchanged(k, n))]
    return max(statistics.median(per_round), 1e-6) if per_round else None


def _alpha_beta(rows: list) -> tuple[float, float]:
    """Alpha-beta fitted to (kind, bytes, seconds) rows, those that ran as exchanges left out
    (``_exchange_alpha``): an all-reduce over 2 ranks (gloo's ring) costs 2 alpha + n / beta,
    a message alpha + n / beta. Alpha from a relative least-squares fit
    over every size (each size weighs alike, so the small ones set it); beta from the large
    messages alone (``LARGE`` bytes and up, plain least squares: the seconds they take), where
    bandwidth, not latency, sets the time: a fit of both over every size gave a bandwidth the
    large messages do not reach (16 MiB all-reduces 40-60% slower than it predicted)."""
    import numpy as np
    rows = [row for row in rows if not _exchanged(row[0], row[1])]
    a = np.array([[2.0 if k == "all_reduce" else 1.0, n] for k, n, _ in rows])
    t = np.array([s for _, _, s in rows])
    (alpha, inv_beta), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    alpha = float(max(alpha, 1e-6))
    big = a[:, 1] >= LARGE
    if big.sum() >= 2:
        rest = t[big] - a[big, 0] * alpha
        inv_beta = float(np.dot(a[big, 1], rest) / np.dot(a[big, 1], a[big, 1]))
    return alpha, float(1 / max(inv_beta, 1e-12))


def measure_all(repeats: int) -> dict:
    """Run ``_profile_worker`` on ``RANKS`` gloo processes; per quantity the slowest rank's
    figure (a step lasts as long as its slowest rank)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "profile")
        port = 29500 + os.getpid() % 1000
        mp.spawn(_profile_worker, args=(port, repeats, out), nprocs=RANKS)
        per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(RANKS)]
    slowest = {k: min(r[k] for r in per_rank) for k in ("f32", "f64", "bw")}
    slowest["op"] = [max(r["op"][i] for r in per_rank) for i in range(2)]
    slowest["executor"] = max(r["executor"] for r in per_rank)
    slowest["overlap"] = min(r["overlap"] for r in per_rank)
    slowest["step_mm"] = [(size, min(r["step_mm"][i][1] for r in per_rank))
                          for i, (size, _) in enumerate(per_rank[0]["step_mm"])]
    slowest["attn"] = [[(e, min(r["attn"][0][i][1] for r in per_rank))
                        for i, (e, _) in enumerate(per_rank[0]["attn"][0])],
                       max(r["attn"][1] for r in per_rank)]
    for k in ("idle", "in_step"):  # rank 0 times the whole exchange, as the others do
        slowest[k] = [tuple(row) for row in per_rank[0][k]]
    return slowest


def _exchange_bytes() -> int:
    from ssdsl.runtime import exchange
    return exchange.MAX_BYTES if exchange.ENABLED else 0


def measure(args: argparse.Namespace) -> None:
    r = args.repeats
    m = measure_all(r)
    op, view = m["op"]
    # the executor's own per-operator work (interpreting the part, adapters, autograd
    # functions) comes on top of eager dispatch, for views as for other operators
    eager = op
    per_op = max(op, m["executor"])
    op, view = per_op, view + per_op - op
    idle_alpha, idle_beta = _alpha_beta(m["idle"])
    gap_alpha, beta = _alpha_beta(m["in_step"])
    # what an all-reduce instruction of the executor costs inside a step, with n a few hundred
    # bytes: over 2 ranks two messages' worth (gloo's ring: 2 alpha + n / beta; by exchanges
    # one round, a send and a receive at once), so half of it is the floor of alpha, and where
    # exchanges run, all of it the floor of their round's latency
    per_call = executor_collective()
    alpha = max(gap_alpha, per_call / 2)
    x_alpha = _exchange_alpha(m["in_step"], beta)
    rounds = _exchanged("all_reduce", 1024)
    if rounds:
        x_alpha = max(x_alpha or 0.0, per_call / rounds)
    prof = {"name": "cpu", "peak": {"float32": m["f32"], "float64": m["f64"]}, "memory": 16e9,
            "memory_bw": m["bw"], "intra_bw": beta, "intra_latency": alpha,
            "inter_bw": beta, "inter_latency": alpha, "per_node": 1024,
            "compute_efficiency": 1.0, "memory_efficiency": 1.0, "op_overhead": op,
            "view_overhead": view, "param_overhead": eager,
            # torch's CPU attention is fused (_scaled_dot_product_flash_attention_for_cpu);
            # whether it skips a causal mask's half, and its rate, are measured
            "flash_attention": True, "causal_skip": m["attn"][1] < 0.75,
            "comm_overlap": m["overlap"],
            # the sums the runtime runs by pairwise exchanges, priced as such
            "exchange_bytes": _exchange_bytes(), "exchange_latency": x_alpha,
            # shares of the float32 peak (float64 products are taken to scale alike)
            "matmul_curve": [[size, rate / m["f32"]] for size, rate in m["step_mm"]],
            "attention_curve": [[n, rate / m["f32"]] for n, rate in m["attn"][0]],
            "source": f"measured by bench/bench_cost.py on this machine ({RANKS} ranks at once, "
                      f"{_threads()} threads per rank, gloo, collectives between computing "
                      f"ranks, {time.strftime('%Y-%m-%d')}, {STAT}s of {r})"}
    PROFILE.write_text(json.dumps(prof, indent=1) + "\n")
    if not getattr(args, "quiet", False):
        print(json.dumps(prof, indent=1))
        print(f"collectives back to back: alpha {idle_alpha * 1e6:.1f} us, beta "
              f"{idle_beta / 1e9:.2f} GB/s; between computing ranks: alpha "
              f"{gap_alpha * 1e6:.1f} us, beta {beta / 1e9:.2f} GB/s; one all-reduce "
              f"instruction in an ssdsl step: {per_call * 1e6:.1f} us; the profile's alpha "
              f"{alpha * 1e6:.1f} us, a round of exchanges "
              f"{(x_alpha or alpha) * 1e6:.1f} us")
        for (kind, n, idle), (_, _, in_step) in zip(m["idle"], m["in_step"]):
            print(f"  {kind:10} {n:>9} B  back to back {idle * 1e6:9.1f} us  "
                  f"in a step {in_step * 1e6:9.1f} us")
        print(f"wrote {PROFILE}")


CASES = [("examples/gpt.py", p) for p in ("dp", "megatron_tp", "1f1b")] + \
        [("bench/gpt_small.py", p) for p in ("dp", "megatron_tp", "1f1b")]


def _measured(model: str, plan: str, steps: int, *flags: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "ssdsl", "run", model, plan, "--nproc",
                          str(RANKS), "--steps", str(steps), "--json", *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out[out.index("{"):])
    ranks = data.get("ranks") or data.get("result", {}).get("ranks")
    return max(r["median_step_ms"] / 1e3 for r in ranks)  # docs/json.md: ranks[].median_step_ms


def _predicted(model: str, plan: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "ssdsl", "cost", model, plan, "--world",
                          str(RANKS), "--device", "cpu", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])


MEASURED = ROOT / "bench" / ("cost_measured.json" if STAT == "median" else f"cost_measured_{STAT}.json")


def calibrate(args: argparse.Namespace) -> None:
    rows = []
    measured_once = False
    saved = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
    for model, plan in CASES:
        if args.only and args.only not in f"{model}:{plan}":
            continue
        key = f"{model}:{plan}"
        if args.reuse and key in saved:
            runs = saved[key]["runs"]
            PROFILE.write_text(json.dumps(saved[key]["profile"], indent=1) + "\n")
        else:
            # the load of a shared machine changes several-fold within minutes: the profile is
            # measured again right before each case's runs (``--profile once``: a quiet machine)
            if args.profile == "each" or not measured_once:
                measure(argparse.Namespace(repeats=args.profile_repeats, quiet=True))
                measured_once = True
            runs = [_measured(model, plan, args.steps) for _ in range(args.repeats)]
            saved[key] = {"runs": runs, "profile": json.loads(PROFILE.read_text())}
            MEASURED.write_text(json.dumps(saved, indent=1) + "\n")
        measured = min(runs) if STAT == "min" else statistics.median(runs)
        pred = _predicted(model, plan)["step_time_s"]
        err = pred / measured - 1
        rows.append({"model": model, "plan": plan, "predicted_ms": pred * 1e3,
                     "measured_ms": measured * 1e3, "runs_ms": [x * 1e3 for x in runs],
                     "error": err})
        print(json.dumps(rows[-1]), flush=True)
    print("| model | plan | predicted ms | measured ms (median) | error |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['plan']} | {r['predicted_ms']:.1f} | "
              f"{r['measured_ms']:.1f} | {r['error']:+.0%} |")


def ops(args: argparse.Namespace) -> None:
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from ssdsl.cost import Cluster, CostOptions
    from ssdsl.cost.ops import aten_name
    from ssdsl.cost.profiles import cpu_profile
    from ssdsl.cost.work import operator_times
    from ssdsl.elaborate import elaborate_file
    from ssdsl.materialize.program import materialize
    from ssdsl.runtime.job import schedule_plan
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file

    torch.set_num_threads(_threads())
    mf = load_model_file(args.model)
    t, lowered = schedule_plan(trace(mf, device="meta"), elaborate_file("dp", world=1))
    m = materialize(t, schedule=lowered)
    opts = CostOptions(profile=cpu_profile(), cluster=Cluster(1, 1))
    fwd_pred, bwd_pred = Counter(), Counter()
    for op, _part, fwd, bwd in operator_times(m, opts):
        fwd_pred[aten_name(op.target)] += fwd
        bwd_pred[aten_name(op.target)] += bwd or 0.0
    model = mf.build()
    inputs, target = mf.get_batch(0)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)

    def step() -> None:
        mf.loss(model(*inputs), target).backward()
        model.zero_grad(set_to_none=True)

    whole = _median_time(step, repeats=args.repeats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.repeats):
            step()
    fwd_meas, bwd_meas = Counter(), Counter()
    node = "autograd::engine::evaluate_function: "
    for e in prof.events():
        if e.cpu_parent is not None:
            continue
        if e.name.startswith(node):
            bwd_meas[e.name.removeprefix(node)] += e.cpu_time_total / 1e6 / args.repeats
        elif e.name.startswith("aten::"):
            fwd_meas[e.name.removeprefix("aten::")] += e.cpu_time_total / 1e6 / args.repeats
    print(f"{args.model}: step (forward + backward, no optimizer) measured "
          f"{whole * 1e3:.2f} ms, predicted {(sum(fwd_pred.values()) + sum(bwd_pred.values())) * 1e3:.2f} ms")
    print(f"forward  predicted {sum(fwd_pred.values()) * 1e3:8.2f} ms, profiled "
          f"{sum(fwd_meas.values()) * 1e3:8.2f} ms")
    print(f"backward predicted {sum(bwd_pred.values()) * 1e3:8.2f} ms, profiled "
          f"{sum(bwd_meas.values()) * 1e3:8.2f} ms")
    print("forward, per ATen kind (ms): predicted  profiled")
    for k in sorted(set(fwd_pred) | set(fwd_meas), key=lambda k: -max(fwd_pred[k], fwd_meas[k])):
        print(f"  {k:34} {fwd_pred[k] * 1e3:9.3f} {fwd_meas[k] * 1e3:9.3f}")
    print("backward predicted, per ATen kind (ms)    | backward profiled, per autograd node (ms)")
    left = [f"{k:28} {v * 1e3:9.3f}" for k, v in bwd_pred.most_common() if v]
    right = [f"{k:44} {v * 1e3:9.3f}" for k, v in bwd_meas.most_common()]
    for i in range(max(len(left), len(right))):
        print(f"  {left[i] if i < len(left) else '':40} | {right[i] if i < len(right) else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--repeats", type=int, default=15)
    m.set_defaults(func=measure)
    c = sub.add_parser("calibrate")
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--steps", type=int, default=16)
    c.add_argument("--profile-repeats", type=int, default=7)
    c.add_argument("--profile", choices=("each", "once"), default="each",
                   help="measure the profile before each case (a loaded machine) or once")
    c.add_argument("--reuse", action="store_true",
                   help=f"predict again against the runs saved in {MEASURED.name}")
    c.add_argument("--only", default=None, help="run only cases whose 'model:plan' contains it")
    c.set_defaults(func=calibrate)
    o = sub.add_parser("ops")
    o.add_argument("model")
    o.add_argument("--repeats", type=int, default=5)
    o.set_defaults(func=ops)
    a = p.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
