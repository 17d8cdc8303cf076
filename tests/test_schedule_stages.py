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
