"""Host memory freed by one training step kept for the next (glibc's ``malloc``, Linux).

PyTorch allocates CPU tensors with the C library's ``malloc`` and keeps no cache of its own.
glibc serves a block above its *mmap threshold* (128 KiB at first, then raised to the largest
such block freed, up to 32 MiB) from a mapping of its own, which ``free`` unmaps, and hands
the top of its heap back to the kernel whenever more than its *trim threshold* lies free
there. A training step frees nearly everything it allocated (activations, gradients of
activations, messages), so each step's tensors fault their pages in afresh, and the kernel
zeroes every page first. On the peers' GPT (bench/bench_peers.py, one forward and backward of
the whole model on 4 sequences, one thread) that was 350-430 minor faults and 0.6-0.9 ms of
system time a step (3% of it); with both thresholds fixed, under one fault a step.

``keep()`` fixes them, once per process, for a rank that trains: blocks up to ``MMAP_BYTES``
come from the heap, and up to ``TRIM_BYTES`` of free heap stay with the process, so a step
reuses the memory the step before it freed. What it costs: the process keeps, after a peak,
up to ``TRIM_BYTES`` it does not use until the next one (the next step's peak, in training).
Larger blocks (a big model's weights, its largest activations) still get mappings of their
own. Setting either threshold turns off glibc's own adjustment of both, which is why both are
set. Where the C library is not glibc (macOS, musl) nothing changes.

``SSDSL_HOST_MEMORY=release`` in the environment, or ``ENABLED = False``, leaves the C
library's defaults (benchmarks compare).
"""

from __future__ import annotations

import ctypes
import os
import sys

# False leaves the C library's thresholds alone (benchmarks compare; see the docstring)
ENABLED = True
MMAP_BYTES = 32 << 20  # the largest block served from the heap (glibc's own ceiling)
TRIM_BYTES = 256 << 20  # the most free heap kept at its top
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3

_DONE: dict[int, bool] = {}  # process id -> whether keep() set the thresholds there


def keep() -> bool:
    """Fix glibc's thresholds in this process, once (see the module docstring); whether they
    are set (False: turned off, or not glibc)."""
    pid = os.getpid()
    if pid in _DONE:
        return _DONE[pid]
    done = False
    if ENABLED and os.environ.get("SSDSL_HOST_MEMORY", "").strip().lower() != "release" \
            and sys.platform.startswith("linux"):
        done = _set_thresholds()
    _DONE.clear()  # a forked child starts with its parent's table
    _DONE[pid] = done
    return done


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: the C library it runs on
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 when it took the value
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                         TRIM_BYTES))
