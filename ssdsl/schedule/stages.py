"""Automatic stages: cut a sequence of operator costs into contiguous, balanced segments.

``stages into n`` without selectors asks for this: the pipeline runs at the pace of its slowest
stage, so the cut minimises the largest segment cost (ties: the earliest cuts).

>>> balance_stages([4, 1, 1, 1, 1, 4], 3)
(range(0, 1), range(1, 5), range(5, 6))
"""

from __future__ import annotations

from collections.abc import Sequence


def _cuts_within(costs: Sequence[float], n: int, limit: float) -> list[int] | None:
    """Greedy: the fewest cuts with every segment at most ``limit``; None when some cost exceeds
    it or more than ``n`` segments are needed. Returns the start index of each segment."""
    starts, total = [0], 0.0
    for i, c in enumerate(costs):
        if c > limit:
            return None
        if total + c > limit:
            starts.append(i)
            total = 0.0
        total += c
    return starts if len(starts) <= n else None


def balance_stages(costs: Sequence[float], n: int) -> tuple[range, ...]:
    """``n`` contiguous non-empty ranges of indices into ``costs`` minimising the largest sum."""
    if not 1 <= n <= len(costs):
        raise ValueError(f"cannot cut {len(costs)} operators into {n} non-empty stages")
    # The optimum is one of the O(k^2) contiguous sums: search them in order.
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    sums = sorted({prefix[j] - prefix[i] for i in range(len(costs)) for j in range(i + 1,
                                                                               len(costs) + 1)})
    lo, hi = 0, len(sums) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _cuts_within(costs, n, sums[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    starts = _cuts_within(costs, n, sums[lo])
    assert starts is not None
    starts = _split_to(starts, len(costs), n)
    ends = starts[1:] + [len(costs)]
    return tuple(range(a, b) for a, b in zip(starts, ends))


def _split_to(starts: list[int], k: int, n: int) -> list[int]:
    # Fewer segments than asked: split the last multi-operator segments (never raises the max).
    starts = list(starts)
    while len(starts) < n:
        bounds = starts + [k]
        i = max(j for j in range(len(starts)) if bounds[j + 1] - bounds[j] > 1)
        starts.insert(i + 1, bounds[i + 1] - 1)
    return starts
