"""The cost model against formulas computed here, independently of ssdsl.cost's code paths:
textbook FLOPs of products and attention, alpha-beta collective times, the analytic 1F1B bubble,
and parameter/optimizer bytes counted from the torch model itself."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import attrs
import pytest

from ssdsl.cost import Cluster, CostOptions, estimate, profile, simulate_costs
from ssdsl.cost.collectives import Link
from ssdsl.cost.ops import work_of
from ssdsl.cost.profiles import DeviceProfile
from ssdsl.cost.work import PlanCosts, StaticMemory, UnitCost, plan_costs, step_times
from ssdsl.elaborate import elaborate_file
from ssdsl.materialize.program import materialize
from ssdsl.materialize.steps import AllGather, AllReduce, Message, PointToPoint
from ssdsl.ir.region import Region
from ssdsl.runtime.job import schedule_plan
from ssdsl.schedule.builders import gpipe, one_f_one_b
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

B, T, C, H, V = 2, 8, 16, 4, 32

MODEL = textwrap.dedent(f"""
    import torch, torch.nn as nn, torch.nn.functional as F
    BATCH_SIZE = {B}
    INPUT_DIMS = (("batch", "seq", "feat"),)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear({C}, {3 * C})
            self.head = nn.Linear({C}, {V}, bias=False)
        def forward(self, x):
            q, k, v = self.qkv(x).split({C}, dim=2)
            q, k, v = (t.view({B}, {T}, {H}, {C // H}).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v)
            y = y.transpose(1, 2).reshape({B}, {T}, {C})
            s = torch.matmul(y, y.transpose(1, 2))      # (B, T, T)
            return self.head(torch.matmul(s, y))

    def build_model():
        return M()

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, {T}, {C}, generator=g), torch.randint(0, {V}, (batch_size, {T}), generator=g)

    def loss(out, target):
        return F.cross_entropy(out.reshape(-1, {V}), target.reshape(-1))
""")

FLAT = DeviceProfile(name="flat", peak={"float32": 1e12}, memory=1e12, memory_bw=1e11,
                     intra_bw=1e10, intra_latency=1e-5, inter_bw=1e9, inter_latency=1e-4,
                     per_node=4)


@pytest.fixture(scope="module")
def tiny_graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("cost") / "tiny.py"
    path.write_text(MODEL)
    return trace(load_model_file(path), device="meta")


def _works(graph, kind: str, plan: str = "dp", world: int = 1, **flags):
    t, _ = schedule_plan(graph, elaborate_file(plan, world=world, sets={}))
    out = []
    for op in graph.ops:
        if op.kind == kind:
            for part in t.parts[op.name]:
                out.append(work_of(graph, op, t.annotations[op.name], part, itemsize=4,
                                   **{"flash": False, **flags}))
    return out


def test_linear_flops_are_2mnk(tiny_graph):
    flops = sorted(w.flops for w in _works(tiny_graph, "linear"))
    assert flops == sorted([2 * B * T * C * 3 * C, 2 * B * T * C * V])


def test_matmul_flops_are_2mnk_per_batch(tiny_graph):
    flops = sorted(w.flops for w in _works(tiny_graph, "matmul"))
    assert flops == sorted([2 * B * T * C * T, 2 * B * T * T * C])


def test_sdpa_flops_are_its_two_products(tiny_graph):
    (w,) = _works(tiny_graph, "sdpa")
    d = C // H
    assert w.flops == 2 * (2 * B * H * T * T * d)
    assert w.bwd_flops == 2 * w.flops


CAUSAL = MODEL.replace("F.scaled_dot_product_attention(q, k, v)",
                       "F.scaled_dot_product_attention(q, k, v, is_causal=True)")


@pytest.mark.parametrize("skip", [True, False])
def test_causal_attention_does_half_the_products_only_where_the_kernel_skips(tmp_path, skip):
    path = tmp_path / "causal.py"
    path.write_text(CAUSAL)
    graph = trace(load_model_file(path), device="meta")
    (w,) = _works(graph, "sdpa", flash=True, causal_skip=skip)
    d = C // H
    full = 2 * (2 * B * H * T * T * d)
    assert w.flops == (full / 2 if skip else full)
    assert w.attention and w.bwd_flops == 2 * w.flops + w.flops / 2  # + Q K^T recomputed
    assert w.scores == T * T


def test_a_split_backward_writes_the_input_gradient(tiny_graph):
    (w,) = _works(tiny_graph, "split")
    assert w.view and w.flops == w.bytes == 0
    assert w.bwd_bytes == 2 * B * T * 3 * C * 4  # the pieces read, the input's gradient written


def test_gpu_attention_runs_at_the_matrix_rate_unless_measured():
    a100 = profile("a100")
    assert a100.attention_rate("float16") == a100.flops_rate("float16")
    assert a100.skips_causal and not profile("v100").skips_causal
    measured = attrs.evolve(a100, attention_efficiency=0.35, causal_skip=False)
    assert measured.attention_rate("float16") == pytest.approx(0.35 * 312e12)
    assert not measured.skips_causal


def test_a_measured_curve_sets_the_rate_by_size():
    flat = attrs.evolve(FLAT, matmul_curve=[[1e6, 0.2], [1e8, 0.6]],
                        attention_curve=[(64 ** 2, 0.25), (256 ** 2, 0.5)])
    peak = 1e12
    assert flat.flops_rate("float32", 1e4) == pytest.approx(0.2 * peak)   # below: the end's
    assert flat.flops_rate("float32", 1e7) == pytest.approx(0.4 * peak)   # halfway in log
    assert flat.flops_rate("float32", 1e10) == pytest.approx(0.6 * peak)
    assert flat.flops_rate("float32") == FLAT.flops_rate("float32") == peak
    assert flat.attention_rate("float32", 128 ** 2) == pytest.approx(0.375 * peak)
    # a profile file's lists load as the same curve
    assert DeviceProfile(**{**attrs.asdict(flat), "peak": {"float32": peak}}) == flat


def test_dp_halves_the_flops_of_each_part(tiny_graph):
    whole = sum(w.flops for w in _works(tiny_graph, "linear"))
    halves = [w.flops for w in _works(tiny_graph, "linear", "dp", 2)]
    assert len(halves) == 4 and sum(halves) == whole


LINK = Link(alpha=3e-5, beta=2e9)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_reduce_time_is_the_ring_formula(p):
    per_member = 64 << 20  # big enough that the ring beats the tree
    total = p
    step = AllReduce(groups=(tuple(range(p)),), nbytes=2 * total * (p - 1) * per_member // p)
    prof = DeviceProfile(name="x", peak={"float32": 1.0}, memory=1, memory_bw=1, intra_bw=2e9,
                         intra_latency=3e-5, inter_bw=1, inter_latency=1, per_node=8)
    opts = CostOptions(profile=prof, cluster=Cluster(p, 8))
    times = step_times(step, 4, opts)
    expect = 2 * (p - 1) * (3e-5 + per_member / (p * 2e9))
    assert set(times) == set(range(p))
    assert all(math.isclose(t, expect, rel_tol=1e-12) for t in times.values())


@pytest.mark.parametrize("p,rounds", [(2, 1), (3, 3), (4, 2), (6, 4), (8, 3)])
def test_a_small_sum_on_an_exchanging_profile_costs_its_rounds_of_messages(p, rounds):
    # recursive doubling, worked out by hand: log2(p) swaps of the whole tensor where p is a
    # power of two; where it is none, gloo's ring (the runtime exchanges only over powers of
    # two, ``exchange.eligible``); past the profile's bound (bytes times rounds) the ring again
    alpha, beta, bound = 3e-5, 2e9, 1 << 20
    prof = DeviceProfile(name="x", peak={"float32": 1.0}, memory=1, memory_bw=1, intra_bw=beta,
                         intra_latency=alpha, inter_bw=1, inter_latency=1, per_node=8,
                         exchange_bytes=bound)
    opts = CostOptions(profile=prof, cluster=Cluster(p, 8))
    for per_member, exchanged in ((bound // rounds, True), (bound // rounds + 4, False)):
        step = AllReduce(groups=(tuple(range(p)),),
                         nbytes=2 * p * (p - 1) * per_member // p)
        times = step_times(step, 4, opts)
        ring = 2 * (p - 1) * (alpha + per_member / (p * beta))
        tree = 2 * math.ceil(math.log2(p)) * (alpha + per_member / beta)
        power = p & (p - 1) == 0
        expect = rounds * (alpha + per_member / beta) if exchanged and power \
            else min(ring, tree)
        assert set(times) == set(range(p))
        assert all(math.isclose(t, expect, rel_tol=1e-12) for t in times.values()), (per_member,
                                                                                      times)
    # a profile without exchanges (the GPUs': NCCL) prices the same small sum as ring or tree
    step = AllReduce(groups=(tuple(range(p)),), nbytes=2 * (p - 1) * 4096)
    nccl = CostOptions(profile=attrs.evolve(prof, exchange_bytes=0.0), cluster=Cluster(p, 8))
    small = step_times(step, 4, nccl)[0]
    assert math.isclose(small, min(2 * (p - 1) * (alpha + 4096 / (p * beta)),
                                   2 * math.ceil(math.log2(p)) * (alpha + 4096 / beta)))


def test_the_cpu_profiles_exchange_what_the_runtime_exchanges():
    # the runtime's bound, not a copy that could drift: the default CPU profile and a measured
    # one price as exchanges exactly the sums ``ssdsl.runtime.exchange`` runs as exchanges
    from ssdsl.cost.profiles import CPU_DEFAULT, CPU_PROFILE_FILE, cpu_profile
    from ssdsl.runtime import exchange
    assert CPU_DEFAULT.exchange_bytes == exchange.MAX_BYTES
    if CPU_PROFILE_FILE.exists():
        assert cpu_profile(CPU_PROFILE_FILE).exchange_bytes == exchange.MAX_BYTES
    for name in ("v100", "a100", "h100"):
        assert profile(name).exchange_bytes == 0


def test_all_gather_across_nodes_uses_the_network_shared_by_the_rings():
    # two groups of 2, each spanning nodes {0, 1} (2 devices per node): each node's network is
    # shared by both rings
    piece = 1 << 20
    step = AllGather(groups=((0, 2), (1, 3)), nbytes=4 * 1 * piece)
    opts = CostOptions(profile=FLAT, cluster=Cluster(4, 2))
    times = step_times(step, 4, opts)
    expect = 1 * (1e-4 + piece / (1e9 / 2))
    assert all(math.isclose(t, expect, rel_tol=1e-12) for t in times.values())


def test_point_to_point_is_alpha_plus_bytes_over_beta():
    region = Region((4, 256), (((0, 4),), ((0, 256),)))
    step = PointToPoint(sources=(), targets=(), messages=(Message(0, 0, 1, 0, region),),
                        nbytes=4 * 256 * 4)
    times = step_times(step, 4, CostOptions(profile=FLAT, cluster=Cluster(2, 4)))
    assert times == {0: pytest.approx(1e-5 + 4096 / 1e10), 1: pytest.approx(1e-5 + 4096 / 1e10)}


def _uniform(schedule, fwd=1.0, bwd=2.0) -> PlanCosts:
    p = schedule.num_devices
    units = {(d, s): UnitCost(fwd_compute=fwd, bwd_compute=bwd)
             for s, d in enumerate(schedule.stages.devices)}
    zero = {d: 0.0 for d in range(p)}
    return PlanCosts(units, {}, {}, zero, zero, {d: StaticMemory(0, 0, 0) for d in range(p)},
                     tuple(range(p)))


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 4), (3, 7), (8, 16)])
@pytest.mark.parametrize("builder", [one_f_one_b, gpipe])
def test_pipeline_bubble_is_analytic(builder, p, m):
    s = builder(p, m)
    opts = CostOptions(profile=FLAT, cluster=Cluster(p, 8))
    r = simulate_costs(_uniform(s), s, tuple((d,) for d in range(p)), opts)
    assert r.bubble == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert r.makespan == pytest.approx(3.0 * (m + p - 1))


def test_1f1b_keeps_at_most_p_minus_s_microbatches():
    p, m = 4, 8
    s = one_f_one_b(p, m)
    costs = _uniform(s)
    units = {k: UnitCost(fwd_compute=1.0, bwd_compute=2.0, activations=100.0)
             for k in costs.units}
    costs = PlanCosts(units, {}, {}, costs.reducer, costs.optimizer, costs.memory, costs.devices)
    opts = CostOptions(profile=FLAT, cluster=Cluster(p, 8))
    r = simulate_costs(costs, s, tuple((d,) for d in range(p)), opts)
    assert [d.peak_activations for d in r.devices] == [100.0 * (p - d) for d in range(p)]


@pytest.fixture(scope="module")
def gpt():
    mf = load_model_file(EXAMPLES / "gpt.py")
    model = mf.build(seed=0)
    return mf, model, trace(mf, device="meta")


def _report(graph, plan: str, world: int, optimizer: str):
    t, lowered = schedule_plan(graph, elaborate_file(plan, world=world, sets={}))
    m = materialize(t, schedule=lowered)
    return estimate(m, CostOptions(profile=FLAT, cluster=Cluster(world, 8), optimizer=optimizer))


def test_dp_holds_every_parameter_on_every_device(gpt):
    _, model, graph = gpt
    numel = sum(p.numel() for p in model.parameters())
    r = _report(graph, "dp", 2, "adamw")
    for d in r.devices:
        assert d.static.params == 4 * numel
        assert d.static.grads == 4 * numel
        assert d.static.optimizer == 2 * 4 * numel  # AdamW: two fp32 moments


def test_megatron_tp_shards_the_block_linears(gpt):
    _, model, graph = gpt
    tp = 2
    expect = [0, 0]
    for name, p in model.named_parameters():
        n = p.numel()
        column = ".attn.c_attn." in name or ".mlp.c_fc." in name
        row = ".attn.c_proj." in name or ".mlp.c_proj." in name
        if column or (row and name.endswith("weight")):
            per = [n // tp] * tp
        elif row:  # a row-parallel bias is added once, by the first part
            per = [n, 0]
        else:
            per = [n] * tp
        expect = [e + q for e, q in zip(expect, per)]
    r = _report(graph, "megatron_tp", tp, "sgd")
    assert [d.static.params for d in r.devices] == [4 * e for e in expect]
    assert [d.static.optimizer for d in r.devices] == [0, 0]  # plain SGD keeps no state


def test_cli_prints_json_for_every_device(capsys):
    import json

    from ssdsl.cli import main
    assert main(["cost", str(EXAMPLES / "gpt.py"), "dp", "--world", "2", "--device", "h100",
                 "--optimizer", "sgd", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["device"] for d in data["devices"]] == [0, 1]
    assert data["device"] == "h100" and data["step_time_s"] > data["pipeline_s"] > 0


def test_cli_refuses_a_node_count_that_does_not_divide_the_world(capsys):
    from ssdsl.cli import main
    assert main(["cost", str(EXAMPLES / "gpt.py"), "dp", "--world", "3", "--nodes", "2"]) == 2
    assert "--nodes 2 does not divide --world 3" in capsys.readouterr().err


def test_cli_costs_a_model_whose_batch_is_made_on_meta(tmp_path, capsys):
    # A planning-only model file (a paper-scale model) makes its batch on the meta device: it
    # has no values to compare, and the cost is the same as for the same model on the CPU.
    import json

    from ssdsl.cli import main
    src = (EXAMPLES / "mlp.py").read_text()
    meta = tmp_path / "mlp_meta.py"
    meta.write_text(src + textwrap.dedent("""

        _cpu_batch = get_batch


        def get_batch(step, batch_size):
            x, y = _cpu_batch(step, batch_size)
            return x.to("meta"), y.to("meta")
        """))
    costs = []
    for path in (EXAMPLES / "mlp.py", meta):
        assert main(["cost", str(path), "dp", "--world", "2", "--optimizer", "sgd",
                     "--json"]) == 0
        costs.append(json.loads(capsys.readouterr().out))
    assert costs[1]["step_time_s"] == pytest.approx(costs[0]["step_time_s"])
    assert [d["peak_memory_bytes"] for d in costs[1]["devices"]] == \
        [d["peak_memory_bytes"] for d in costs[0]["devices"]]


def _gpt_graph(tmp_path: Path, n_layer: int):
    path = tmp_path / f"gpt_{n_layer}.py"
    path.write_text(f"import importlib.util\n"
                    f"_s = importlib.util.spec_from_file_location('_gpt', {str(EXAMPLES / 'gpt.py')!r})\n"
                    "_g = importlib.util.module_from_spec(_s)\n_s.loader.exec_module(_g)\n"
                    "BATCH_SIZE, INPUT_DIMS, get_batch = _g.BATCH_SIZE, _g.INPUT_DIMS, _g.get_batch\n"
                    f"def build_model():\n    return _g.build_gpt(n_layer={n_layer})\n")
    return trace(load_model_file(path), device="meta")


RECOMPUTE_TP = """plan megatron_recompute(tp: int = world)
use megatron_tp(tp=tp)
recompute h.*.attn | h.*.mlp
"""


def _costed(graph, plan: str, world: int):
    t, lowered = schedule_plan(graph, elaborate_file(plan, world=world, sets={}))
    m = materialize(t, schedule=lowered)
    opts = CostOptions(profile=FLAT, cluster=Cluster(world, 8), optimizer="sgd")
    return plan_costs(m, opts), estimate(m, opts)


def test_a_backward_recreates_one_recomputed_region_at_a_time(tmp_path):
    # Each block's attention and MLP is its own recomputed region (the all-reduce after their
    # row-parallel linear ends it), and the runtime recomputes one region at a time: what a
    # backward re-creates does not grow with the depth, while what the forward keeps does.
    plan = tmp_path / "megatron_recompute.ssp"
    plan.write_text(RECOMPUTE_TP)
    peaks = {}
    for n_layer in (2, 4):
        graph = _gpt_graph(tmp_path, n_layer)
        (_, plain), (costs, rec) = _costed(graph, "megatron_tp", 2), _costed(graph, str(plan), 2)
        kept = costs.units[(0, 0)]
        assert kept.recompute > 0 and kept.recompute_peak > 0
        # recomputing keeps less from forward to backward than keeping everything
        assert rec.devices[0].peak_activations < plain.devices[0].peak_activations
        peaks[n_layer] = (kept.recompute_peak, kept.activations)
    assert peaks[4][0] == pytest.approx(peaks[2][0])       # one region at a time
    assert peaks[4][1] > peaks[2][1]                        # the regions' inputs stay alive


def test_forward_only_recycling_passes_keep_no_activations():
    # recycle_1f1b on the recycling Evoformer: the stages the schedule phase finds forward-only
    # (the detached passes) run under no_grad, so the cost model keeps nothing and runs no
    # backward for them, and the trained pass's stages keep their activations.
    graph = trace(load_model_file(EXAMPLES / "evoformer_recycle.py"), device="meta")
    t, lowered = schedule_plan(graph, elaborate_file("recycle_1f1b", world=2, sets={}))
    frozen = lowered.schedule.stages.forward_only
    assert frozen
    costs = plan_costs(materialize(t, schedule=lowered),
                       CostOptions(profile=FLAT, cluster=Cluster(2, 8), optimizer="sgd"))
    for (_device, stage), c in costs.units.items():
        if stage in frozen:
            assert c.activations == 0 and c.bwd_compute == 0 and c.fwd_compute > 0
        else:
            assert c.activations > 0 and c.bwd_compute > 0


@pytest.mark.parametrize("hidden", [1.0, 0.0])
def test_overlapped_bucket_parts_run_beside_the_last_backward(hidden):
    # one device, one micro-batch: forward 1 s, backward 10 s (from 1 to 11); a first part
    # final halfway through the backward (2 s), a second final at its end (3 s), then a
    # bucket that is not overlapped (4 s)
    s = one_f_one_b(1, 1)
    costs = attrs.evolve(_uniform(s, fwd=1.0, bwd=10.0), reducer={0: 4.0},
                         overlapped={0: ((0.5, 2.0), (1.0, 3.0))})
    prof = attrs.evolve(FLAT, comm_overlap=hidden)
    r = simulate_costs(costs, s, ((0,),), CostOptions(profile=prof, cluster=Cluster(1, 8)))
    # the first part runs from 6 to 8 beside the backward; the second from 11 to 14
    assert r.makespan == pytest.approx(11.0)
    assert r.reducer_time == pytest.approx(3.0 + 4.0 + (1 - hidden) * 2.0)
    assert r.devices[0].communication == pytest.approx(2.0 + 3.0 + 4.0)


def test_a_device_that_ends_its_backward_early_reduces_its_bucket_meanwhile():
    # 1F1B over 2 stages: stage 1's last backward ends one backward before stage 0's
    s = one_f_one_b(2, 2)
    costs = attrs.evolve(_uniform(s), reducer={0: 0.0, 1: 1.5})
    r = simulate_costs(costs, s, ((0,), (1,)), CostOptions(profile=FLAT, cluster=Cluster(2, 8)))
    assert r.makespan == pytest.approx(3.0 * 3)
    assert r.reducer_time == 0.0  # 1.5 s inside the 2 s stage 0 still computes


SMALL = EXAMPLES.parent / "bench" / "gpt_small.py"


@pytest.mark.parametrize("plan, world, sets", [
    ("dp", 2, {}), ("dp_tp_1f1b", 8, {"dp": "2", "tp": "2", "pp": "2"}), ("dp_zero", 2, {})])
def test_the_cost_model_overlaps_the_buckets_the_executor_overlaps(plan, world, sets):
    """What the cost model reduces during the last backward is what the runtime's own rule
    picks on each rank's lowered program (bench/gpt_small.py: a 14 MiB gradient)."""
    from ssdsl.cost.work import _executor_overlap
    from ssdsl.lower import lower_rank
    from ssdsl.lower.overlap import overlap_plan

    graph = trace(load_model_file(SMALL), device="meta")
    t, lowered = schedule_plan(graph, elaborate_file(plan, world=world, sets=sets))
    m = materialize(t, schedule=lowered)
    costs = plan_costs(m, CostOptions(profile=FLAT, cluster=Cluster(world, 8)))
    seen = 0
    for d in range(world):
        program = lower_rank(m, d)
        reduces = {ins.bucket: ins for ins in program.instructions if ins.kind == "reduce"}
        nbytes = {e: e[1].numel() * 4 for ins in reduces.values() for e in ins.entries}
        run = overlap_plan(program, nbytes)
        want = [tuple(reduces[b].entries[j] for j in pos)
                for b, parts in (run.parts.items() if run else ()) for pos in parts]
        mine = m.reducer.buckets_of(d)
        split, _whole = _executor_overlap(m, d, mine, nbytes)
        got = [tuple(mine[i].entries[j] for j in pos) for i, parts in split.items()
               for pos in parts]
        assert got == want
        assert len(costs.overlapped[d]) == len(want)
        seen += len(want)
    assert seen or plan == "dp_zero"


def _direct_regions(m):
    """The recomputed regions read off every rank's own program, lowered by itself."""
    from ssdsl.lower import lower_rank
    out = {}
    for rank in range(m.transformed.world):
        seen, current, region, number = set(), None, None, 0
        for ins in lower_rank(m, rank, direct=True).instructions:
            if ins.kind == "begin":
                stage = ins.unit.partition("F")[0]
                current = "F" in ins.unit and stage not in seen
                seen.add(stage) if current else None
                region = None
            elif not current:
                continue
            elif ins.kind == "recompute":
                number += 1
                region = (rank, number)
            elif ins.kind == "end_recompute":
                region = None
            elif ins.kind == "call" and region is not None:
                out[(rank, ins.op, tuple(ins.part))] = region
    return out


PIPE_RECOMPUTE = """plan pipe_recompute()
use dp_tp_1f1b(dp=2, tp=1, pp=2, microbatches=2)
recompute h.*.mlp
"""


@pytest.mark.parametrize("plan, world, sets", [
    ("coshard", 2, {"colocate": "2"}), ("megatron_recompute", 4, {}), ("pipe", 4, {})])
def test_recomputed_regions_read_once_per_rank_class_are_every_rank_s(gpt, tmp_path, plan,
                                                                     world, sets):
    from ssdsl.cost.work import recomputed_regions
    _, _, graph = gpt
    if plan != "coshard":
        path = tmp_path / f"{plan}.ssp"
        path.write_text(RECOMPUTE_TP if plan == "megatron_recompute" else PIPE_RECOMPUTE)
        plan = str(path)
    t, lowered = schedule_plan(graph, elaborate_file(plan, world=world, sets=sets))
    m = materialize(t, schedule=lowered)
    want = _direct_regions(m)
    assert want and recomputed_regions(m) == want


@pytest.mark.parametrize("dims, groups, pad, stride", [
    (2, 1, 1, 1), (2, 4, 1, 1), (2, 16, 1, 2), (2, 1, 0, 1), (1, 2, 2, 1), (2, 1, 0, 4)])
def test_convolution_flops_are_torch_s_count(tmp_path, dims, groups, pad, stride):
    from torch.utils.flop_counter import FlopCounterMode
    kernel = 4 if stride == 4 else 3
    conv, size = ("Conv2d", "12, 12") if dims == 2 else ("Conv1d", "12")
    path = tmp_path / "conv.py"
    path.write_text(textwrap.dedent(f"""
        import torch, torch.nn as nn
        BATCH_SIZE = 2
        INPUT_DIMS = (("batch", "c", {'"h", "w"' if dims == 2 else '"t"'}),)
        def build_model():
            return nn.{conv}(16, 32, {kernel}, padding={pad}, stride={stride}, groups={groups})
        def get_batch(step, b):
            g = torch.Generator().manual_seed(step)
            return torch.randn(b, 16, {size}, generator=g), torch.zeros(b)
        def loss(out, target):
            return out.sum()
    """))
    mf = load_model_file(path)
    graph = trace(mf, device="meta")
    t, _ = schedule_plan(graph, elaborate_file("dp", world=1, sets={}))
    (op,) = [op for op in t.graph.ops if "conv" in op.target]
    w = work_of(t.graph, op, t.annotations[op.name], t.parts[op.name][0], itemsize=4,
                flash=False)
    inputs, _ = mf.get_batch(0)
    with FlopCounterMode(display=False) as counter:
        mf.build()(*inputs)
    assert w.flops == counter.get_total_flops()


@pytest.mark.parametrize("m", [2, 4, 7])
@pytest.mark.parametrize("how, lasts, computes", [
    # walked in two: an input half of 1, then a whole backward of 2
    ("sent_first", 3.0, lambda m: m * 1.0 + (m - 1) * 2.0 + 3.0),
    # split in halves: an input half of 1, then a weight half of 1
    ("split_first", 2.0, lambda m: m * 3.0),
])
def test_a_last_backward_that_sends_first_lets_the_stage_before_start_early(m, how, lasts,
                                                                            computes):
    """Two stages, F = 1, B = 2, no communication; stage 1's last backward sends its gradient
    after an input half (1), so stage 0's last backward ends by hand at 3 (m + 1) - 1 instead of
    3 (m + 1). Walked in two, that backward lasts 3; split in halves, 2 like any other, and
    stage 1 computes nothing more than 3 m."""
    s = one_f_one_b(2, m)
    costs = attrs.evolve(_uniform(s), **{how: frozenset({(1, 1, m - 1)})})
    opts = CostOptions(profile=FLAT, cluster=Cluster(2, 8))
    r = simulate_costs(costs, s, ((0,), (1,)), opts)
    assert r.makespan == pytest.approx(3.0 * (m + 1) - 1)
    last = {iv.rank: iv for iv in r.intervals if iv.unit.mb == m - 1 and iv.unit.kind.value == "B"}
    assert last[1].end - last[1].start == pytest.approx(lasts)
    assert last[0].start == pytest.approx(last[1].start + 1.0)
    assert r.devices[1].compute == pytest.approx(computes(m))


@pytest.mark.parametrize("split", [True, False])
def test_the_cost_model_reads_which_backwards_the_lowering_splits_or_walks_in_two(
        gpt, monkeypatch, split):
    import ssdsl.lower.build as build
    monkeypatch.setattr(build, "SPLIT_LAST", split)
    _, _, graph = gpt
    t, lowered = schedule_plan(graph, elaborate_file("1f1b", world=2, sets={}))
    m = materialize(t, schedule=lowered)
    costs = plan_costs(m, CostOptions(profile=FLAT, cluster=Cluster(2, 8)))
    # split: the last stage's last backward and (``build.DEFER_W``: stage 1 defers its first
    # one's weight half to the end) its first; walked in two: its last micro-batch's alone
    assert (costs.split_first, costs.sent_first) == (
        (frozenset({(1, 1, 0), (1, 1, 3)}), frozenset()) if split
        else (frozenset(), frozenset({(1, 1, 3)})))
    # the first one does its input half, the last its own backward and the first's weight half
    assert costs.backward_work == ({(1, 1, 0): 0.5, (1, 1, 3): 1.5} if split else {})


@pytest.mark.parametrize("m", [2, 4])
def test_a_deferred_weight_half_keeps_its_activations_until_it_runs(m):
    """``build.DEFER_W``: stage 1 (the last of 2) runs its first backward's input half alone and
    that weight half in its last backward, so micro-batch 0's activations stay until then.
    1F1B on the last stage is F0 B0 F1 B1 ...: by hand, one forward's activations (A) at most
    without the deferral, 2 A with it (micro-batch 0's and the current one's), and nothing left
    at the end."""
    a = 5.0
    s = one_f_one_b(2, m)
    units = {k: attrs.evolve(c, activations=a) for k, c in _uniform(s).units.items()}
    opts = CostOptions(profile=FLAT, cluster=Cluster(2, 8))
    plain = attrs.evolve(_uniform(s), units=units)
    deferred = attrs.evolve(plain, split_first=frozenset({(1, 1, 0), (1, 1, m - 1)}),
                            backward_work={(1, 1, 0): 0.5, (1, 1, m - 1): 1.5})
    groups = ((0,), (1,))
    assert simulate_costs(plain, s, groups, opts).devices[1].peak_activations == a
    r = simulate_costs(deferred, s, groups, opts)
    assert r.devices[1].peak_activations == 2 * a
    assert r.devices[1].memory_timeline[-2][1] == 0.0  # all freed by the last backward's end
