"""A GroupNorm between two convolutions follows a split of the output channels (its groups are
the outer factor of the channel dim), so a tensor-parallel ResNet-style block costs one
all-reduce in forward and nothing in backward (the first convolution reads the batch), with
no all-gather; and it trains like the plain model (float64, every
rank simulated in one process, ``verify_plan``; oracle: the single-device model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.elaborate import elaborate_text
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import verify_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "conv_groupnorm.py"
PLAN = ("plan p(n: int = world)\n"
        "partition conv1 | bn1 | act1 along out into n\n"
        "partition conv2 along in into n\n"
        "replicate rest into n\n"
        "assign each part i to device i\n")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_group_norm_follows_the_channel_split(world: int) -> None:
    mf = load_model_file(MODEL)
    graph = trace(mf, device="cpu", model=mf.build(seed=0).to(torch.float64))
    m = materialize(transform(graph, elaborate_text(PLAN, "p.ssp", world=world)),
                    dtype=torch.float64)
    norm = next(op.name for op in graph.ops if op.kind == "group_norm")
    assert all(not p.replica[-1] for p in m.transformed.parts[norm])  # split, not replicated
    acc = m.accounting()
    assert set(acc["forward"]) - {"chunk"} == {"all_reduce"}  # after conv2 only
    assert acc["forward"]["all_reduce"]["count"] == 1
    assert set(acc["backward"]) - {"chunk"} == set()  # conv1 reads the batch: no input grad
    assert acc["gradients"] == {}
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]
