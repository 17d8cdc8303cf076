"""The tables that keep planning linear in parts agree with the scans they replaced (the scans
are written out here as the reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.elaborate import elaborate_file
from ssdsl.materialize.program import materialize
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def transformed():
    graph = trace(load_model_file(str(GPT)), device="meta")
    plan = elaborate_file("dp_tp_1f1b", world=8, sets={"dp": "2", "tp": "2", "pp": "2",
                                                      "microbatches": "2"})
    return schedule_plan(graph, plan)


def _scanned(t, part, slot):
    """``grad_value_part`` as it was: a scan of the operator's parts for each reader."""
    region = part.sub.inputs[slot]
    siblings = sorted({p.partition_index for p in t.parts[part.op]
                       if p.sub.inputs[slot] == region and p.replica_index == part.replica_index})
    return siblings.index(part.partition_index), len(siblings)


def test_grad_value_part_table_matches_the_scan(transformed):
    t, _ = transformed
    checked = 0
    for op in t.graph.ops:
        for part in t.parts[op.name]:
            for slot, region in enumerate(part.sub.inputs):
                if region is not None:
                    assert t.grad_value_part(part, slot) == _scanned(t, part, slot)
                    checked += 1
    assert checked > 100


def test_regions_are_made_once_and_equal_fresh_ones(transformed):
    from ssdsl.ir.region import Region
    t, lowered = transformed
    materialize(t, schedule=lowered)
    op = t.graph.ops[3]
    part = t.parts[op.name][0]
    name, ivs = op.outputs[0], part.sub.outputs[0]
    assert t.region(name, ivs) is t.region(name, ivs)
    assert t.region(name, ivs, (1, 2)) == Region(t.shape(name), ivs, part=(1, 2))


def test_the_tag_stride_grows_only_for_a_plan_that_needs_it(transformed):
    """Tags are ``base * stride + i``: a plan whose largest adapter sends more messages than
    ``TAG_STRIDE`` (4,096 ranks) gets a larger stride; any other keeps its tags."""
    from types import SimpleNamespace

    import torch

    from ssdsl.ir.region import Region
    from ssdsl.lower.build import TAG_STRIDE, localize, tag_stride
    from ssdsl.materialize.p2p import plan_p2p

    t, lowered = transformed
    assert tag_stride(materialize(t, schedule=lowered)) == TAG_STRIDE
    n = TAG_STRIDE + 1  # one row to each of n devices
    step = plan_p2p((n, 1), torch.float32, [(0, Region((n, 1), (((0, n),), ((0, 1),))))],
                    [(d, Region((n, 1), (((d, d + 1),), ((0, 1),)))) for d in range(n)])
    adapter = SimpleNamespace(steps=(step,), backward=None)
    stride = tag_stride(SimpleNamespace(edges={"e": SimpleNamespace(adapter=adapter)}))
    assert stride == 2 * TAG_STRIDE
    (p2p,) = localize(adapter, 0, 3, stride)
    assert min(m.tag for m in p2p.msgs) >= 3 * stride
    with pytest.raises(ValueError):
        localize(adapter, 0, 3)
