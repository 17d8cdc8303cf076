"""The standard pipeline schedules, built directly in Python.

These are oracles for tests and defaults for tools: they do not read the stdlib ``.ssp`` plans,
so a test can compare what a plan lowers to against an independent construction.

- ``gpipe``: every forward, then every backward (GPipe).
- ``one_f_one_b``: warm-up forwards, then alternate one forward and one backward (PipeDream-flush,
  Megatron's default).
- ``interleaved_1f1b``: Megatron's interleaved schedule, device d hosting stages d, d+p, ...
- ``zb_h1``: 1F1B with split backwards, each weight half deferred to fill the bubble (ZB-H1).
- ``gpipe_recycle`` and ``three_f_one_b``: a recycling trunk (AlphaFold2) of ``r`` passes, each
  over every device (``recycle_stages``), only the last with backwards: GPipe (every forward,
  then every backward) and 3F1B (``stdlib_plans/recycle_1f1b.ssp``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ssdsl.schedule.units import B, F, Pass, Program, Schedule, StageGraph, Unit


def _schedule(stages: StageGraph, m: int, per_device: Iterable[Iterable[Unit]], *,
              split: bool = False) -> Schedule:
    return Schedule(stages, m, [Program.of(d, units) for d, units in enumerate(per_device)],
                    split_backward=split)


def gpipe(p: int, m: int, *, stages: StageGraph | None = None) -> Schedule:
    """GPipe on ``p`` devices with ``m`` micro-batches: all forwards, then all backwards.

    With ``stages`` (any stage DAG, skip edges and several stages per device allowed) each device
    runs the forwards of its stages in micro-batch order, then their backwards in the same order.
    """
    g = stages or StageGraph.chain(range(p))
    progs = []
    for d in range(g.num_devices):
        mine = g.stages_on(d)
        fwd = [F(s, i) for i in range(m) for s in mine]
        bwd = [B(s, i) for i in range(m) for s in reversed(mine)]
        progs.append(fwd + bwd)
    return _schedule(g, m, progs)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B on a chain of ``p`` stages, stage d on device d.

    Device d first runs ``min(p - d - 1, m)`` forwards, then alternates forward and backward, then
    drains the remaining backwards; at most ``p - d`` micro-batches are alive on device d.
    """
    progs = []
    for d in range(p):
        warm = min(p - d - 1, m)
        units = [F(d, i) for i in range(warm)]
        for i in range(m - warm):
            units += [F(d, warm + i), B(d, i)]
        units += [B(d, i) for i in range(m - warm, m)]
        progs.append(units)
    return _schedule(StageGraph.chain(range(p)), m, progs)


def interleaved_stages(p: int, v: int) -> StageGraph:
    """A chain of ``p * v`` stages where stage s lives on device ``s % p`` (v chunks per device)."""
    return StageGraph.chain([s % p for s in range(p * v)])


def _interleaved_unit(k: int, d: int, p: int, v: int, *, forward: bool) -> Unit:
    # k-th forward (or backward) of device d: chunks rotate every p units, micro-batches advance
    # by groups of p, backwards visit chunks in reverse (Megatron's ordering).
    chunk = (k // p) % v
    mb = (k // (p * v)) * p + k % p
    if not forward:
        chunk = v - 1 - chunk
    stage = chunk * p + d
    return F(stage, mb) if forward else B(stage, mb)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B with ``v`` model chunks per device; ``m`` must be a multiple of
    ``p``. Device d runs ``2 (p - d - 1) + (v - 1) p`` warm-up forwards, then alternates."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) divisible by devices ({p})")
    total = m * v
    progs = []
    for d in range(p):
        warm = min(2 * (p - d - 1) + (v - 1) * p, total)
        units = [_interleaved_unit(k, d, p, v, forward=True) for k in range(warm)]
        for i in range(total - warm):
            units.append(_interleaved_unit(warm + i, d, p, v, forward=True))
            units.append(_interleaved_unit(i, d, p, v, forward=False))
        units += [_interleaved_unit(k, d, p, v, forward=False) for k in range(total - warm, total)]
        progs.append(units)
    return _schedule(interleaved_stages(p, v), m, progs)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) on a chain of ``p`` stages.

    Device d runs 1F1B's forwards and, in place of each backward, its input half ``I``; the
    weight half ``W`` of micro-batch k runs right after the input half of micro-batch
    ``k + d`` (the rest after the last one). Nobody waits for a ``W``, so deferring it lets the
    ``I`` units, which the stage before waits for, run early, and the ``W`` units fill what
    was the bubble; ``p`` micro-batches at most are alive on any device, 1F1B's peak.
    """
    progs = []
    for d in range(p):
        warm = min(p - d - 1, m)
        delay = min(d, m)
        units = [F(d, i) for i in range(warm)]
        for k in range(m):
            if k < m - warm:
                units.append(F(d, warm + k))
            units.append(Unit(d, Pass.I, k))
            if k >= delay:
                units.append(Unit(d, Pass.W, k - delay))
        units += [Unit(d, Pass.W, k) for k in range(m - delay, m)]
        progs.append(units)
    return _schedule(StageGraph.chain(range(p)), m, progs, split=True)


def recycle_stages(p: int, r: int) -> StageGraph:
    """``r`` passes of a trunk cut into ``p`` stages: stage ``k * p + d`` is pass k on device d,
    a chain (pass k + 1 starts from pass k's output), the first ``r - 1`` passes forward-only."""
    n = p * r
    return StageGraph([s % p for s in range(n)], [(s, s + 1) for s in range(n - 1)],
                      range((r - 1) * p))


def _recycle_forward(k: int, d: int, p: int, r: int) -> Unit:
    # micro-batches go through the passes of a device in groups of p (interleaved 1F1B's order)
    return F(k // p % r * p + d, k // (p * r) * p + k % p)


def gpipe_recycle(p: int, m: int, r: int) -> Schedule:
    """GPipe with recycling: every pass of every micro-batch forward, then the backwards of the
    last pass. Forwards take the passes in groups of ``p`` micro-batches, so that pass k + 1 of a
    micro-batch starts on device 0 just as pass k leaves the last device."""
    if m % p:
        raise ValueError(f"{m} micro-batches are not a multiple of {p} devices")
    last = (r - 1) * p
    progs = [[_recycle_forward(k, d, p, r) for k in range(m * r)]
             + [B(last + d, i) for i in range(m)] for d in range(p)]
    return _schedule(recycle_stages(p, r), m, progs)


def three_f_one_b(p: int, m: int, r: int) -> Schedule:
    """3F1B (``r`` = 3): the forwards in ``gpipe_recycle``'s order; after a warm-up, each backward
    of the last pass is followed by the next ``r`` forwards. Device d warms up with the
    forwards of the first ``r - 1`` passes of the first group, one of the last pass, and
    3 (p - d - 1) more: the time, with B = 2F, until its first backward comes back."""
    if m % p:
        raise ValueError(f"{m} micro-batches are not a multiple of {p} devices")
    last, total = (r - 1) * p, m * r
    progs = []
    for d in range(p):
        warm = min((r - 1) * p + 3 * (p - d - 1) + 1, total)
        units = [_recycle_forward(k, d, p, r) for k in range(warm)]
        for j in range(m):
            units.append(B(last + d, j))
            units += [_recycle_forward(k, d, p, r)
                      for k in range(min(warm + j * r, total), min(warm + (j + 1) * r, total))]
        progs.append(units)
    return _schedule(recycle_stages(p, r), m, progs)
