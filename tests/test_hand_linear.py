"""A linear written by hand, ``x @ self.weight.T`` (Falcon's ``FalconLinear``): ``x.T`` is an
``aten.numpy_T`` (once unannotated) and the product a ``matmul`` whose right operand is the
weight, whose dims a plan names as a linear's (``out``, ``in``: once unknown to a matmul, so
megatron_tp refused Falcon's MLP). Split column- then row-parallel, it costs what
``nn.Linear`` does: one forward all-reduce after the row-parallel product, one backward
all-reduce before the column-parallel one. Oracle: the plain model in float64
(``verify_plan`` simulates every rank and compares the loss and every gradient)."""

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

MODEL = Path(__file__).resolve().parent / "models" / "hand_linear.py"


@functools.cache
def _graph():
    mf = load_model_file(MODEL)
    return mf, trace(mf, device="cpu", model=mf.build(seed=0))


def _plan(body: str):
    return elaborate_text("plan p(n: int = world)\n" + body + "replicate rest into n\n"
                          "assign each part i to device i\n", "p.ssp", world=2)


def test_hand_linears_column_then_row_parallel_are_the_minimum() -> None:
    mf, graph = _graph()
    plan = _plan("partition mlp except mlp.down along out into n\n"
                 "partition mlp.down along in into n\n")
    m = materialize(transform(graph, plan), dtype=torch.float64)
    acc = m.accounting()
    assert {k: v["count"] for k, v in acc["forward"].items()} == {"all_reduce": 1}
    assert {k: v["count"] for k, v in acc["backward"].items()} == {"all_reduce": 1}
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]


@pytest.mark.parametrize("body", ["partition mlp.up along in into n\n",
                                  "partition mlp.down along out into n\n"])
def test_hand_linear_split_the_other_way_matches(body: str) -> None:
    mf, graph = _graph()
    m = materialize(transform(graph, _plan(body)), dtype=torch.float64)
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]


def test_attention_scores_have_no_linear_words() -> None:
    """Only a matrix on the right is a weight: a batched product (q @ k.T) has no ``out``."""
    from ssdsl.ops import annotate_call
    from tests.test_ops_oracle import make_call
    call, _ = make_call("aten.matmul.default", [torch.randn(2, 4, 3, 8), torch.randn(2, 4, 8, 3)])
    assert dict(annotate_call(call).words) == {}
    call, _ = make_call("aten.matmul.default", [torch.randn(2, 4, 8), torch.randn(8, 3)])
    assert dict(annotate_call(call).words) == {"out": "n", "in": "k"}
