"""Megatron's minimum communication (finding 7 of issue 10): one all-reduce per row-parallel
linear in forward, and one per column-parallel group in backward, also when the group is several
linears reading one activation (LLaMA's q, k, v and gate, up): their partial input gradients are
summed on each device and all-reduced once. Checked against the plain model in float64 by
simulating every rank (``verify_plan``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_file
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import verify_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"blocks": "layers.*", "attn": "self_attn", "attn_out": "self_attn.o_proj",
         "mlp": "mlp", "mlp_out": "mlp.down_proj"}


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_layout_under_megatron_is_the_minimum(tp: int) -> None:
    mf = load_model_file(ROOT / "tests" / "models" / "llama_like.py")
    graph = trace(mf, device="cpu", model=mf.build(seed=0))
    plan = elaborate_file("megatron_tp", world=tp, sets=NAMES)
    m = materialize(transform(graph, plan), dtype=torch.float64)
    acc = m.accounting()
    layers = 2
    # forward: o_proj and down_proj per layer; backward: (q, k, v) and (gate, up) per layer
    assert acc["forward"] == {"all_reduce": {"count": 2 * layers, "bytes": acc["forward"][
        "all_reduce"]["bytes"]}}
    assert set(acc["backward"]) == {"all_reduce"}
    assert acc["backward"]["all_reduce"]["count"] == 2 * layers
    assert acc["backward"]["all_reduce"]["bytes"] == acc["forward"]["all_reduce"]["bytes"]
    assert acc["gradients"] == {}  # the replicated norms get identical gradients
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]
