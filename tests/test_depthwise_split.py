"""A depthwise conv between the two linears of an MLP (SegFormer's Mix-FFN) follows their
column-parallel split by whole groups: one forward all-reduce (after fc2) and one backward
all-reduce (before fc1), as for a plain MLP. A grouped conv's groups were frozen, so the conv
was replicated and its input gathered (megatron_tp refused SegFormer's MLP: 'grouped
convolution'). Oracle: the plain model in float64 (``verify_plan`` simulates every rank)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_text
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import verify_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

MODEL = Path(__file__).resolve().parent / "models" / "mix_ffn.py"


@functools.cache
def _graph():
    mf = load_model_file(MODEL)
    return mf, trace(mf, device="cpu", model=mf.build(seed=0))


def _materialized(body: str, world: int):
    mf, graph = _graph()
    plan = elaborate_text("plan p(n: int = world)\n" + body + "replicate rest into n\n"
                          "assign each part i to device i\n", "p.ssp", world=world)
    return mf, materialize(transform(graph, plan), dtype=torch.float64)


@pytest.mark.parametrize("world", [2, 4])
def test_depthwise_conv_follows_the_column_parallel_split(world: int) -> None:
    mf, m = _materialized("partition mlp except mlp.fc2 along out into n\n"
                          "partition mlp.fc2 along in into n\n", world)
    acc = m.accounting()
    assert {k: v["count"] for k, v in acc["forward"].items()} == {"all_reduce": 1}
    assert {k: v["count"] for k, v in acc["backward"].items()} == {"all_reduce": 1}
    conv = next(op.name for op in m.transformed.graph.ops if op.kind == "conv2d")
    assert not any(any(p.replica) for p in m.transformed.parts[conv])
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]


def test_depthwise_conv_split_by_its_own_out_matches() -> None:
    """``out`` of a grouped conv names its groups."""
    mf, m = _materialized("partition mlp.dwconv along out into n\n", 2)
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]
