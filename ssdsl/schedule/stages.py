"""Automatic stages: cut a sequence of operator costs into contiguous, balanced segments.

``stages into n`` without selectors asks for this: the pipeline runs at the pace of its slowest
stage, so the cut minimises the largest segment cost (ties: the earliest cuts).

>>> balance_stages([4, 1, 1, 1, 1, 4], 3)
(range(0, 1), range(1, 5), range(5, 6))

Every cut also sends what crosses it, in every micro-batch, both ways: a cut inside a
transformer block sends the residual stream and the attention's queries, keys and values (or an
MLP's 4x-wide hidden layer), where a cut between blocks sends the residual stream alone. Given
``crossing[i]``, the bytes a cut before index i sends, and ``slack``, the cut takes, among those
whose largest segment is within ``1 + slack`` of the best, the ones that send the least, and
among those the best balanced:

>>> balance_stages([2, 1, 1, 2], 2, crossing=[0, 9, 1, 9], slack=0.5)
(range(0, 2), range(2, 4))
"""

from __future__ import annotations

import bisect
from collections import deque
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


def balance_stages(costs: Sequence[float], n: int, crossing: Sequence[float] | None = None,
                   slack: float = 0.0) -> tuple[range, ...]:
    """``n`` contiguous non-empty ranges of indices into ``costs`` minimising the largest sum;
    with ``crossing`` and ``slack`` > 0, the least crossing within that slack (module doc).

    >>> balance_stages([0, 1, 1, 1, 1, 1, 1, 5, 0], 4)
    (range(0, 3), range(3, 5), range(5, 7), range(7, 9))

    Where the largest segment is more than ``HEAVY`` times the others' mean (an LM head that
    outweighs several blocks), it bounds every cut and many cuts tie at its size; the least
    crossing among them bunches the others up to its size beside near-empty segments. Then the
    others are balanced among themselves, on each side of it (each side by this same rule),
    keeping the largest segment as it was."""
    ranges, least = _balance(costs, n, crossing, slack)
    # what the largest segment may be: the best balance's, within the slack where it trades
    # balance for crossing
    limit = least * (1 + slack) if crossing is not None and slack > 0 else least
    sums = [sum(costs[i] for i in r) for r in ranges]
    worst = max(sums)
    if n < 3 or worst <= HEAVY * (sum(costs) - worst) / (n - 1):
        return ranges
    # the largest segment that bounds the cut: the one holding the heaviest item if it is one
    # of the largest, else the largest with the fewest items
    top = max(range(len(costs)), key=costs.__getitem__)
    heavy = min((r for r, c in zip(ranges, sums) if c == worst),
                key=lambda r: (top not in r, len(r)))
    a0, b0 = heavy.start, heavy.stop
    left, right = costs[:a0], costs[b0:]
    guess = round((n - 1) * sum(left) / max(sum(left) + sum(right), 1e-300))
    best: tuple[float, tuple[range, ...]] | None = None
    # each side gets its share of the n - 1 other segments; a side given none joins the
    # largest where that keeps it within the limit (the loss's normalization after an LM head,
    # which a segment of its own would only waste a rank on)
    for nl in sorted({guess - 1, guess, guess + 1, 0, n - 1}):
        nr = n - 1 - nl
        if not (0 <= nl <= len(left) and 0 <= nr <= len(right)):
            continue
        middle = range(a0 if nl else 0, b0 if nr else len(costs))
        if sum(costs[i] for i in middle) > limit * (1 + 1e-12) + 1e-12:
            continue
        a = balance_stages(left, nl, None if crossing is None else crossing[:a0], slack) \
            if nl else ()
        b = balance_stages(right, nr, None if crossing is None else crossing[b0:], slack) \
            if nr else ()
        rest = max([sum(left[k] for k in r) for r in a] + [sum(right[k] for k in r) for r in b],
                   default=0.0)
        found = (*a, middle, *(range(r.start + b0, r.stop + b0) for r in b))
        if best is None or rest < best[0]:
            best = (rest, found)
    return best[1] if best is not None and best[0] < _others(sums, worst) else ranges


def _others(sums: list[float], worst: float) -> float:
    """The largest segment but one (the largest counted once)."""
    rest = list(sums)
    rest.remove(worst)
    return max(rest, default=0.0)


# How much heavier than the other segments' mean the largest must be for them to be balanced
# among themselves (``balance_stages``)
HEAVY = 1.5


def _balance(costs: Sequence[float], n: int, crossing: Sequence[float] | None,
             slack: float) -> tuple[tuple[range, ...], float]:
    """The cut of the module doc, and the best balance's largest segment."""
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
    if crossing is not None and slack > 0 and n > 1:
        starts = _least_crossing(prefix, n, crossing, sums, lo, sums[lo] * (1 + slack))
    else:
        starts = _cuts_within(costs, n, sums[lo])
        assert starts is not None
        starts = _split_to(starts, len(costs), n)
    ends = starts[1:] + [len(costs)]
    return tuple(range(a, b) for a, b in zip(starts, ends)), sums[lo]


def _least_crossing(prefix: list[float], n: int, crossing: Sequence[float], sums: list[float],
                    lo: int, limit: float) -> list[int]:
    """Segment starts of ``n`` segments, each at most ``limit``, with the least total crossing;
    then the smallest limit (one of ``sums`` from ``sums[lo]``) that keeps that least total."""
    best, starts = _min_crossing(prefix, n, crossing, limit)
    a, b = lo, max(lo, bisect.bisect_right(sums, limit) - 1)
    while a < b:  # the least total never grows with the limit: the first limit that reaches it
        mid = (a + b) // 2
        found, at = _min_crossing(prefix, n, crossing, sums[mid])
        if found is not None and found <= best:
            b, starts = mid, at
        else:
            a = mid + 1
    return starts


def _min_crossing(prefix: list[float], n: int, crossing: Sequence[float], limit: float
                  ) -> tuple[float | None, list[int]]:
    """The least total ``crossing`` over cuts into ``n`` non-empty segments of sum at most
    ``limit``, and the segment starts (None, []: no such cut). ``best[i]`` is the least total
    for ``prefix`` length i in j segments; for each j the window of feasible starts of the last
    segment slides right with i, so a monotone deque keeps its minimum: O(n k)."""
    k = len(prefix) - 1
    limit = limit * (1 + 1e-12) + 1e-12
    inf = float("inf")
    best = [0.0] + [inf] * k  # one segment: [0, i) when within the limit
    for i in range(1, k + 1):
        best[i] = 0.0 if prefix[i] - prefix[0] <= limit else inf
    parents: list[list[int]] = []
    for _ in range(1, n):
        nxt, parent = [inf] * (k + 1), [-1] * (k + 1)
        window: deque[int] = deque()
        left = 1
        for i in range(2, k + 1):
            s = i - 1  # the newest start: the last segment is [s, i)
            if best[s] < inf:
                value = best[s] + crossing[s]
                while window and best[window[-1]] + crossing[window[-1]] > value:
                    window.pop()
                window.append(s)
            while prefix[i] - prefix[left] > limit:
                left += 1
            while window and window[0] < left:
                window.popleft()
            if window:
                nxt[i] = best[window[0]] + crossing[window[0]]
                parent[i] = window[0]
        best = nxt
        parents.append(parent)
    if best[k] == inf:
        return None, []
    starts, i = [], k
    for parent in reversed(parents):
        i = parent[i]
        starts.append(i)
    return best[k], [0, *reversed(starts)]


def _split_to(starts: list[int], k: int, n: int) -> list[int]:
    # Fewer segments than asked: split the last multi-operator segments (never raises the max).
    starts = list(starts)
    while len(starts) < n:
        bounds = starts + [k]
        i = max(j for j in range(len(starts)) if bounds[j + 1] - bounds[j] > 1)
        starts.insert(i + 1, bounds[i + 1] - 1)
    return starts
