"""Cyclic garbage collection paused while planning builds its tables.

Planning a large plan makes millions of long-lived objects (parts, regions, adapters) and few
reference cycles. Python's collector runs a full pass over every tracked object each time the
survivors grow by a quarter, so a phase that builds millions of them pays for many passes that
find almost nothing (at 256 ranks of GPT-3, a second or more each; one pass every nine ranks of
code generation). ``gc_paused`` turns the collector off for a phase and back on after it, so the
cycles a phase leaves are collected as before, only later; reference counting frees everything
else as usual. Nested uses keep it off until the outermost ends.

    >>> import gc
    >>> with gc_paused():
    ...     gc.isenabled()
    False
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused(*, keep: bool = False) -> Iterator[None]:
    """Cyclic garbage collection off inside the block (as it was after it).

    When it comes back on, the collector's youngest generation holds every object the block made
    and the next collection scans them all once. ``keep``: instead, everything alive at the end
    is moved out of the collector's view for good (``gc.freeze``): for a process that plans once
    and exits (``ssdsl compile``, ``bench/bench_plan.py``), whose planning objects live as long
    as it does; a cycle among them is never collected."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if keep:
            gc.freeze()
        if was:
            gc.enable()
