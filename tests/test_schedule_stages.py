"""Balanced stages against a brute force over every way to cut."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ssdsl.schedule.stages import balance_stages


def _brute_best(costs, n):
    k = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, k), n - 1):
        b = (0,) + cuts + (k,)
        worst = max(sum(costs[b[i]:b[i + 1]]) for i in range(n))
        best = worst if best is None else min(best, worst)
    return best


@given(st.lists(st.integers(1, 20), min_size=1, max_size=9), st.integers(1, 9))
def test_balance_matches_brute_force(costs, n):
    n = min(n, len(costs))
    parts = balance_stages(costs, n)
    assert len(parts) == n and all(len(r) > 0 for r in parts)
    assert [i for r in parts for i in r] == list(range(len(costs)))
    assert max(sum(costs[i] for i in r) for r in parts) == _brute_best(costs, n)


def test_balance_rejects_too_many_stages():
    with pytest.raises(ValueError):
        balance_stages([1, 2], 3)


def _brute_least_crossing(costs, n, crossing, slack):
    """Every cut: the least total crossing within (1 + slack) of the best balance, then the
    smallest largest segment among those."""
    k = len(costs)
    cuts_all = list(itertools.combinations(range(1, k), n - 1))
    worst = {c: max(sum(costs[b[i]:b[i + 1]]) for b in [(0, *c, k)] for i in range(n))
             for c in cuts_all}
    limit = min(worst.values()) * (1 + slack)
    ok = [c for c in cuts_all if worst[c] <= limit + 1e-9]
    least = min(sum(crossing[i] for i in c) for c in ok)
    return least, min(worst[c] for c in ok if sum(crossing[i] for i in c) == least)


@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=9),
       st.integers(1, 9), st.sampled_from([0.1, 0.25, 1.0]))
def test_least_crossing_within_the_slack_matches_brute_force(items, n, slack):
    costs = [c for c, _ in items]
    crossing = [x for _, x in items]
    n = min(n, len(costs))
    parts = balance_stages(costs, n, crossing=crossing, slack=slack)
    assert len(parts) == n and all(len(r) > 0 for r in parts)
    assert [i for r in parts for i in r] == list(range(len(costs)))
    if n == 1:
        return
    least, worst = _brute_least_crossing(costs, n, crossing, slack)
    assert sum(crossing[r.start] for r in parts[1:]) == least
    assert max(sum(costs[i] for i in r) for r in parts) == worst


def test_a_convolutions_cost_is_its_multiply_adds(tmp_path):
    """``op_cost`` of a convolution: batch x output channels x output positions x input
    channels x kernel (oracle: the shapes, by hand), not times the input positions as well
    (which made a ResNet's stem outweigh the whole rest and put every layer on one stage)."""
    from ssdsl.elaborate import elaborate_file
    from ssdsl.schedule.resolve import op_cost
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.transform import transform

    (tmp_path / "conv.py").write_text(
        "import torch\nimport torch.nn as nn\nBATCH_SIZE = 2\n"
        "INPUT_DIMS = (('batch', 'c', 'h', 'w'),)\n"
        "def build_model():\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 5, stride=2, padding=2), nn.Flatten(),"
        " nn.Linear(8 * 16 * 16, 4))\n"
        "def get_batch(step, batch_size):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    return ((torch.randn(batch_size, 3, 32, 32, generator=g),),"
        " torch.randint(0, 4, (batch_size,), generator=g))\n")
    (tmp_path / "p.ssp").write_text("plan p()\nassign all to device 0\n")
    graph = trace(load_model_file(str(tmp_path / "conv.py")), device="meta")
    t = transform(graph, elaborate_file(str(tmp_path / "p.ssp"), world=1))
    (conv,) = [op for op in graph.ops if op.kind == "conv2d"]
    assert op_cost(t, conv) == 2 * 8 * 16 * 16 * 3 * 5 * 5
