"""Whether the ranks on this host each have cores of their own.

Two choices depend on it. A rank whose compute threads leave a core free gains from doing work
off its critical path in a thread or in a walk of its own (``ssdsl.runtime.sender``: sends
issued by a thread; ``Materialized.send_first``: a last backward walked twice so that its
gradients leave first, where the lowering cannot split it in halves); where the ranks already
fill the cores (4 one-thread ranks on 2 cores), that work takes a core another rank needs, and
the step gets longer. A GPU rank always
has its device to itself: these choices concern CPU ranks only.
"""

from __future__ import annotations

import os

# the launcher's CPUs, and a pinned rank's own (``ssdsl.runtime.launch`` sets both), comma-separated
HOST_CPUS_VAR = "SSDSL_HOST_CPUS"
RANK_CPUS_VAR = "SSDSL_RANK_CPUS"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), or, in a rank the launcher pinned to
    some of them, the launcher's: the host's cores its helper threads may use."""
    host = pinned_host_cpus()
    if host is not None:
        return len(host)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def pinned_host_cpus() -> set[int] | None:
    """The launcher's CPUs where it pinned this rank to some of them, else None."""
    got = os.environ.get(HOST_CPUS_VAR)
    if not got or not os.environ.get(RANK_CPUS_VAR):
        return None
    try:
        return {int(c) for c in got.split(",")}
    except ValueError:
        return None


def local_ranks() -> int:
    """The ranks on this host, as torchrun and ``ssdsl.runtime.launch`` say (1 alone)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def own_cores(local: int | None = None, threads: int | None = None,
              cpus: int | None = None) -> bool:
    """Whether ``local`` ranks (this host's, by default) of ``threads`` compute threads each
    (this process's) fit ``cpus`` cores (this host's usable ones) with a core each.

    >>> own_cores(2, 1, 2), own_cores(4, 1, 2), own_cores(2, 2, 4), own_cores(2, 2, 3)
    (True, False, True, False)
    """
    local = local_ranks() if local is None else local
    if threads is None:
        import torch  # not at import: the launcher asks before it needs torch
        threads = torch.get_num_threads()
    cpus = usable_cpus() if cpus is None else cpus
    return local * max(1, threads) <= max(1, cpus)
