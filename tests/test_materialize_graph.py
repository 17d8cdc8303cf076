"""Communication on real graphs: primitives, bytes and verification of whole plans on gpt.py.

Oracles, none of them computed by the materializer:
- the primitive sequence and bytes of each plan are written here from first principles (which
  tensors a plan must move, with the byte convention of ``ssdsl.materialize.steps``: the total
  received by all devices, all-reduce ``2(p-1)b``, all-to-all ``(p-1)b`` for ``b`` bytes per
  device, point-to-point the bytes of each message between distinct devices);
- sizes come from the model itself (its parameters and the batch), not from the graph;
- ``verify_plan`` compares each adapter's result with slices of full random tensors, and the
  simulated step with the plain single-device model (float64, SGD, ``run_reference``).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from rich.console import Console

from ssdsl.elaborate import elaborate_file, elaborate_text
from ssdsl.materialize.program import Materialized, materialize
from ssdsl.materialize.reducer import GradReducer, Weight, plan_grad_reducer
from ssdsl.materialize.steps import PointToPoint
from ssdsl.materialize.report import comm_report
from ssdsl.runtime.verify import verify_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
F64 = torch.float64
ITEM = 8  # bytes of a float64

_CACHE: dict = {}


def gpt():
    """(model file, graph traced on the CPU, the seeded model) once per session."""
    if "gpt" not in _CACHE:
        mf = load_model_file(GPT)
        net = mf.build(seed=0)
        _CACHE["gpt"] = mf, trace(mf, device="cpu", model=net), net
    return _CACHE["gpt"]


def sizes() -> dict[str, int]:
    """B, T, C, L and the parameter count, read from the model and its batch."""
    mf, _, net = gpt()
    (tokens,), _ = mf.get_batch(0)
    return {"B": tokens.shape[0], "T": tokens.shape[1], "C": net.wte.embedding_dim,
            "L": len(net.h), "params": sum(p.numel() for p in net.parameters()),
            "wpe": net.wpe.weight.numel()}


def build(plan: str, world: int, **sets: str) -> Materialized:
    """Materialize a stdlib plan name or a plan text (one containing a newline) on gpt.py."""
    _, graph, _ = gpt()
    key = (plan, world, tuple(sorted(sets.items())))
    if key not in _CACHE:
        sets_ = {k: str(v) for k, v in sets.items()}
        el = (elaborate_text(plan, "test.ssp", world=world, sets=sets_) if "\n" in plan
              else elaborate_file(plan, world=world, sets=sets_))
        _CACHE[key] = materialize(transform(graph, el), dtype=F64)
    return _CACHE[key]


def module_of(op: str) -> str:
    _, graph, _ = gpt()
    return next(o.module for o in graph.ops if o.name == op)


def moving(m: Materialized) -> dict:
    """The edges whose forward or backward adapter has any step."""
    return {k: e for k, e in m.edges.items()
            if e.adapter.steps or (e.adapter.backward is not None and e.adapter.backward.steps)}


# Split everything by batch but the GELU of block 0, which is split by sequence: the data must be
# re-split between them (an all-to-all each way), never gathered.
A2A = """plan a2a(n: int = world)
partition h.0.mlp except (h.0.mlp.c_fc | h.0.mlp.c_proj) along seq into n
partition rest along batch into n
assign each part i to device i
"""

# Data parallel, but block 0's first MLP linear has its two parts on the devices in the other
# order: the regular layouts agree, the devices do not; the data must go point to point.
SWAP = """plan swap(n: int = world)
partition all along batch into n
assign each part i of (all except h.0.mlp.c_fc) to device i
assign each part i of h.0.mlp.c_fc to device n - 1 - i
"""

# Uneven: block 0's first MLP linear split in two on devices 0 and 2, everything else replicated
# on devices 0, 1 and 2.
UNEVEN = """plan uneven()
partition h.0.mlp.c_fc along out into 2
replicate rest into 3
assign part 0 of h.0.mlp.c_fc to device 0
assign part 1 of h.0.mlp.c_fc to device 2
for i in 0..3:
    assign part i of (all except h.0.mlp.c_fc) to device i
"""


# ------------------------------------------------------------------------------ data parallel

@pytest.mark.parametrize("p", [2, 4])
def test_dp_gradients_are_one_all_reduce_per_bucket(p: int) -> None:
    s = sizes()
    m = build("dp", p)
    acc = m.accounting()
    assert acc["forward"] == {}
    # every weight's gradient is a contribution from each batch part: one bucket (under 25 MiB)
    # summed across all p devices. The position embedding has no batch dim, so its op is
    # replicated; its backward runs on each device's partial output gradient, and the sum is
    # taken on its weight gradient, in the same bucket, not on the (T, C) activation gradient.
    grad_bytes = s["params"] * ITEM
    assert acc["gradients"] == {"all_reduce": {"count": 1, "bytes": 2 * (p - 1) * grad_bytes}}
    assert [b.devices for b in m.reducer.buckets] == [tuple(range(p))]
    assert acc["backward"] == {}
    assert acc["total_bytes"] == 2 * (p - 1) * grad_bytes
    verdict = verify_plan(m, model_file=gpt()[0])
    assert verdict.ok, verdict.problems


def test_dp_buckets_split_by_size_and_move_the_same_bytes() -> None:
    s = sizes()
    m = build("dp", 2)
    weights = [Weight(name, region.shape, F64, ((0, region), (1, region)))
               for b in m.reducer.buckets for name, region in b.entries]
    one_each = plan_grad_reducer(weights, bucket_bytes=0)
    n_weights = sum(1 for _ in gpt()[2].parameters())  # tied weights once
    assert len(one_each.buckets) == n_weights
    assert one_each.accounting() == {"all_reduce": (n_weights, 2 * s["params"] * ITEM)}
    largest = max(b.size for b in one_each.buckets)
    some = plan_grad_reducer(weights, bucket_bytes=largest)
    assert 1 < len(some.buckets) < n_weights
    assert all(b.size <= largest for b in some.buckets)
    assert some.nbytes == one_each.nbytes


# ------------------------------------------------------------------------------ Megatron TP

@pytest.mark.parametrize("p", [2, 4])
def test_megatron_one_all_reduce_per_row_parallel_linear(p: int) -> None:
    s = sizes()
    m = build("megatron_tp", p)
    act = s["B"] * s["T"] * s["C"] * ITEM
    forward, backward = [], []
    for (tensor, op, _slot), e in moving(m).items():
        producer = m.transformed.graph.producer()[tensor].name
        back = e.adapter.backward.kinds
        if e.adapter.kinds:
            # forward: only the partial sums of a row-parallel linear are reduced
            assert e.adapter.kinds == ("all_reduce",), (tensor, op)
            assert module_of(producer).endswith(("attn.c_proj", "mlp.c_proj")), producer
            assert back == (), (tensor, op)
            forward.append(e.adapter.nbytes)
        else:
            # backward: only the input of a column-parallel linear (Megatron's f)
            assert back == ("all_reduce",), (tensor, op)
            assert module_of(op).endswith(("attn.c_attn", "mlp.c_fc")), op
            backward.append(e.adapter.backward.nbytes)
        assert m.transformed.graph.tensors[tensor].shape == (s["B"], s["T"], s["C"])
    assert forward == [2 * (p - 1) * act] * (2 * s["L"])
    assert backward == [2 * (p - 1) * act] * (2 * s["L"])
    acc = m.accounting()
    per_pass = {"all_reduce": {"count": 2 * s["L"], "bytes": 2 * s["L"] * 2 * (p - 1) * act}}
    assert acc["forward"] == per_pass and acc["backward"] == per_pass
    assert acc["gradients"] == {}  # every weight is either sharded or a copy on each device


def test_dp_tp_volume_is_megatron_per_dp_group_plus_dp_gradient_sums() -> None:
    s = sizes()
    dp, tp = 2, 2
    m = build("dp_tp", dp * tp, dp=dp)
    acc = m.accounting()
    act = (s["B"] // dp) * s["T"] * s["C"] * ITEM  # one dp group's activation
    n_ar = 2 * s["L"] * dp
    assert acc["forward"] == {"all_reduce": {"count": n_ar, "bytes": n_ar * 2 * (tp - 1) * act}}
    # backward: Megatron's f in each dp group, nothing else (the position embedding's partial
    # output gradients are summed on its weight, with the other weights)
    assert acc["backward"] == {"all_reduce": {"count": n_ar, "bytes": n_ar * 2 * (tp - 1) * act}}
    # weights: summed over dp, one bucket per tp rank. A tp rank holds its shard of the split
    # weights (the row-parallel biases live on tp rank 0 only) and all of the replicated ones
    # (token and position embeddings / LM head, layer norms), so the tp ranks together hold every
    # weight once plus tp - 1 more copies of the replicated ones.
    net = gpt()[2]
    replicated = net.wte.weight.numel() + net.wpe.weight.numel() + sum(
        p.numel() for mod in net.modules() if isinstance(mod, torch.nn.LayerNorm)
        for p in mod.parameters())
    held = s["params"] + (tp - 1) * replicated
    assert acc["gradients"] == {"all_reduce": {"count": tp,
                                               "bytes": 2 * (dp - 1) * held * ITEM}}
    assert sorted(b.devices for b in m.reducer.buckets) == [(0, 2), (1, 3)]


# ------------------------------------------------------------------------------ all-to-all

@pytest.mark.parametrize("p", [2, 4])
def test_batch_then_seq_split_is_an_all_to_all_not_a_gather(p: int) -> None:
    s = sizes()
    m = build(A2A, p)
    back = lambda e: e.adapter.backward.kinds if e.adapter.backward else ()  # noqa: E731 (no grad)
    kinds = [k for e in m.edges.values() for k in (*e.adapter.kinds, *back(e))]
    assert "all_gather" not in kinds and "chunk" not in kinds
    hidden = s["B"] * s["T"] * 4 * s["C"] * ITEM
    a2a = {(t, op): e for (t, op, _), e in m.edges.items() if "all_to_all" in e.adapter.kinds}
    assert set(a2a) == {("linear_2", "gelu"), ("gelu", "linear_3")}
    for e in a2a.values():
        assert e.adapter.kinds == ("all_to_all",) and e.adapter.backward.kinds == ("all_to_all",)
        assert e.adapter.nbytes == e.adapter.backward.nbytes == (p - 1) * hidden // p
    verdict = verify_plan(m, model_file=gpt()[0])
    assert verdict.ok, verdict.problems


# ------------------------------------------------------------------------------ the verifier

@pytest.mark.parametrize(("plan", "world"), [("dp", 2), ("megatron_tp", 2), ("megatron_tp", 4),
                                             ("dp_tp", 4), (SWAP, 2), (UNEVEN, 3)],
                         ids=["dp-2", "megatron_tp-2", "megatron_tp-4", "dp_tp-4", "swap-2",
                              "uneven-3"])
def test_verifier_passes_and_matches_the_plain_model(plan: str, world: int) -> None:
    mf = gpt()[0]
    m = build(plan, world, **({"dp": 2} if plan == "dp_tp" else {}))
    verdict = verify_plan(m, model_file=mf, seed=3)
    assert verdict.ok, verdict.problems
    assert verdict.edges_checked == len(m.edges) > 0
    model = mf.build(seed=3).to(F64)
    (tokens,), target = mf.get_batch(0)
    with torch.no_grad():
        want = float(mf.loss(model(tokens), target))
    assert verdict.loss == pytest.approx(want, rel=1e-12)
    assert verdict.max_grad_error < 1e-12
    irregular = "\n" in plan
    assert bool(verdict.fallback_edges) == irregular


@pytest.mark.parametrize(("plan", "world"), [(SWAP, 2), (UNEVEN, 3)], ids=["swap", "uneven"])
def test_irregular_plans_use_the_point_to_point_fallback(plan: str, world: int) -> None:
    s = sizes()
    m = build(plan, world)
    moved = moving(m)
    p2p_edges = {(t, op) for (t, op, _), e in moved.items()
                 if any(isinstance(x, PointToPoint) for x in e.adapter.steps)}
    # into and out of the first MLP linear of block 0
    assert p2p_edges == {("layer_norm_1", "linear_2"), ("linear_2", "gelu")}
    x = s["B"] * s["T"] * s["C"] * ITEM
    h = 4 * x
    acc = m.accounting()
    if plan is SWAP:
        # each device sends its batch half of the input and of the output to the other
        assert acc["forward"] == {"p2p": {"count": 4, "bytes": x + h}}
        assert acc["backward"]["p2p"] == {"count": 4, "bytes": x + h}
    else:
        # forward: the input is replicated on 0 and 2 already; the halves of the output go
        # 0 -> 2, 2 -> 0, and both to device 1.  backward: the two parts' partial gradients of
        # the input go 0 -> 2, 2 -> 0, and both to device 1 (device 1's replica needs the sum)
        assert acc["forward"] == {"p2p": {"count": 4, "bytes": 2 * h}}
        assert acc["backward"] == {"p2p": {"count": 4, "bytes": 4 * x}}
        assert acc["gradients"] == {}


def test_verifier_catches_a_missing_backward_all_reduce() -> None:
    m = build("megatron_tp", 2)
    key = next(k for k, e in moving(m).items() if e.adapter.backward.kinds == ("all_reduce",))
    edge = m.edges[key]
    broken = attrs.evolve(edge.adapter, backward=attrs.evolve(edge.adapter.backward, steps=()))
    bad = attrs.evolve(m, edges={**m.edges, key: attrs.evolve(edge, adapter=broken)})
    verdict = verify_plan(bad, model_file=gpt()[0])
    assert not verdict.ok
    assert any(str(key) in p and "backward" in p for p in verdict.problems)
    assert any("gradient of" in p for p in verdict.problems)  # the whole-graph check too


def test_verifier_catches_a_missing_gradient_reducer() -> None:
    m = build("dp", 2)
    bad = attrs.evolve(m, reducer=GradReducer(()))
    verdict = verify_plan(bad, model_file=gpt()[0])
    # every adapter is still right and so is the loss: only the whole step can tell
    assert verdict.problems and all("gradient of" in p for p in verdict.problems)
    assert verdict.loss == pytest.approx(verdict.reference_loss, rel=1e-12)


def test_verifier_catches_an_adapter_for_the_wrong_regions() -> None:
    m = build("dp", 2)
    key = next(k for k in m.edges if k[1] == "linear_2")
    other = next(k for k in m.edges if k[1] == "linear_3")  # a different tensor's adapter
    bad = attrs.evolve(m, edges={**m.edges, key: attrs.evolve(m.edges[key],
                                                               adapter=m.edges[other].adapter)})
    verdict = verify_plan(bad)
    assert any(str(key) in p and "differ" in p for p in verdict.problems)


# ------------------------------------------------------------------------------ the report

def test_comm_report_shows_the_analytic_volume() -> None:
    s = sizes()
    p = 2
    table, data = comm_report(build("megatron_tp", p))
    act = s["B"] * s["T"] * s["C"] * ITEM
    total = 2 * (2 * s["L"]) * 2 * (p - 1) * act
    assert data["total_bytes"] == total
    assert data["forward"]["all_reduce"] == {"count": 2 * s["L"], "bytes": total // 2}
    assert len(data["edges"]) == 4 * s["L"] and data["fallback_edges"] == 0
    console = Console(record=True, width=100)
    console.print(table)
    text = console.export_text()
    assert "all_reduce" in text and f"{total / 1024:.1f} KiB" in text


def test_comm_report_counts_fallback_edges() -> None:
    table, data = comm_report(build(UNEVEN, 3))
    assert data["fallback_edges"] == 2
    assert sum(1 for e in data["edges"] if e["fallback"]) == 2
    assert "fallback" in str(table.caption)

