"""A fused gate_up linear cut by ``chunk(2)`` (Phi-3's MLP), split column-parallel along
``out``: its output features are the factors (which half, features in a half); the split goes
inside the halves, so each rank holds half of the gate and half of the up features, and the
chunk, the activation and the product follow it. Megatron's minimum: one forward all-reduce
(after ``down``), one backward all-reduce (before ``gate_up``). It once split which half
(rank 0 the gate, rank 1 the up) and gathered both halves for the product. Oracle: the plain
model in float64 (``verify_plan`` simulates every rank and compares every gradient)."""

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

MODEL = Path(__file__).resolve().parent / "models" / "fused_gate_up.py"


@functools.cache
def _graph():
    mf = load_model_file(MODEL)
    return mf, trace(mf, device="cpu", model=mf.build(seed=0))


def _materialized(body: str, world: int = 2):
    mf, graph = _graph()
    plan = elaborate_text("plan p(n: int = world)\n" + body + "replicate rest into n\n"
                          "assign each part i to device i\n", "p.ssp", world=world)
    return mf, materialize(transform(graph, plan), dtype=torch.float64)


@pytest.mark.parametrize("world", [2, 3])
def test_fused_gate_up_split_inside_the_halves_is_the_minimum(world: int) -> None:
    mf, m = _materialized("partition mlp except mlp.down along out into n\n"
                          "partition mlp.down along in into n\n", world)
    acc = m.accounting()
    assert {k: v["count"] for k, v in acc["forward"].items()} == {"all_reduce": 1}
    assert {k: v["count"] for k, v in acc["backward"].items()} == {"all_reduce": 1}
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]
    # the chunk follows: every rank holds a part of it, none a whole copy
    chunk = next(op.name for op in m.transformed.graph.ops if op.kind == "chunk")
    assert len(m.transformed.parts[chunk]) == world
    assert not any(any(p.replica) for p in m.transformed.parts[chunk])


def test_fused_gate_up_split_of_the_halves_themselves_still_matches() -> None:
    """A plan may still name the outer factor (n_0: which half); it is exact, with a gather."""
    mf, m = _materialized("partition mlp.gate_up along n_0 into n\n")
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]
