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
