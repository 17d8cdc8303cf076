"""Plans that name heads on attention written out with matmuls (finding 8 of issue 10): the
trace names the heads dim of ``q @ k.T``, softmax and ``@ v``, and ``partition X along heads``
on it trains like the plain model (float64, all ranks simulated in one process)."""

from __future__ import annotations

from pathlib import Path

import torch

from ssdsl.elaborate import elaborate_text
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import verify_plan
from ssdsl.ops import label_for_name
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

MODEL = Path(__file__).resolve().parent / "models" / "manual_attention.py"

PLAN = """plan heads(n: int = world)
partition attn except attn.proj along heads into n
partition attn.proj along in into n
replicate rest into n
assign each part i to device i
"""


def _traced():
    mf = load_model_file(MODEL)
    return mf, trace(mf, device="cpu", model=mf.build(seed=0))


def test_written_out_attention_has_heads() -> None:
    _, graph = _traced()
    for kind in ("matmul", "softmax"):
        ops = [op for op in graph.ops if op.kind == kind]
        assert ops and all(label_for_name(graph, op, "heads") for op in ops), kind
    qkv = next(op for op in graph.ops if op.module == "attn.qkv")
    assert label_for_name(graph, qkv, "heads") is not None


def test_partition_along_heads_matches_the_plain_model() -> None:
    mf, graph = _traced()
    m = materialize(transform(graph, elaborate_text(PLAN, "heads.ssp", world=2)),
                    dtype=torch.float64)
    acc = m.accounting()
    assert acc["forward"]["all_reduce"]["count"] == 1  # the row-parallel proj only
    assert "all_gather" not in acc["forward"] and "all_gather" not in acc["backward"]
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]


def _ranges(graph, body: str, op_module: str) -> set:
    plan = "plan p(n: int = world)\n" + body + "replicate rest into n\nassign each part i to device i\n"
    t = transform(graph, elaborate_text(plan, "p.ssp", world=2))
    op = next(o for o in graph.ops if o.module == op_module and o.kind in ("linear", "addmm"))
    return {p.ranges for p in t.parts[op.name]}


def test_out_on_a_fused_qkv_linear_splits_the_heads_and_factors_are_writable() -> None:
    from tests.test_materialize_graph import gpt
    _, graph, _ = gpt()
    qkv = next(o for o in graph.ops if o.module == "h.0.attn.c_attn")
    heads = label_for_name(graph, qkv, "heads")[1]
    by_out = _ranges(graph, "partition h.0.attn.c_attn along out into n\n", "h.0.attn.c_attn")
    assert {tuple(dict(r)) for r in by_out} == {(heads,)}
    assert by_out == _ranges(graph, "partition h.0.attn.c_attn along heads into n\n",
                             "h.0.attn.c_attn")
    # the table writes factors with '_' (the grammar has no dotted names); a plan reads them back
    inner = _ranges(graph, "partition h.0.attn.c_attn along n_2 into n\n", "h.0.attn.c_attn")
    assert {tuple(dict(r)) for r in inner} == {("n.2",)}
