"""Time of collectives and point-to-point messages by the alpha-beta model.

A message of ``n`` bytes over a link costs ``alpha + n / beta`` (latency plus bytes over the
link's bandwidth). For a group of ``p`` devices, each holding ``n`` bytes (the buffer a member
passes to the call), the bandwidth-optimal ring algorithms take ``p - 1`` (``2 (p - 1)`` for an
all-reduce) steps that each move ``n / p`` bytes per member::

    all-reduce      ring: 2 (p-1) (alpha + n / (p beta))     tree: 2 log2(p) (alpha + n / beta)
    all-gather      (p-1) (alpha + n / beta)                 (n: the piece each member holds)
    reduce-scatter  (p-1) (alpha + n / (p beta))
    all-to-all      (p-1) (alpha + n / (p beta))
    send/recv       alpha + n / beta

An all-reduce takes the faster of ring and tree, as NCCL chooses by size; on a link whose profile
runs small sums by pairwise exchanges (``DeviceProfile.exchange_bytes``: the CPU profile, as
``ssdsl.runtime.exchange`` does on gloo) it takes what those cost where they run::

    exchanges       r (alpha_x + n / beta)  r = log2(p) rounds (p a power of 2)

(each round a member sends its whole running sum and receives its partner's, both at once;
``alpha_x`` is the fixed cost of one such round, ``DeviceProfile.exchange_latency``: measured,
it is not a message's). They run where ``p`` is a power of two and ``r n`` stays within
``exchange_bytes``; gloo's ring elsewhere. The link is the slowest
one the ring crosses: NVLink (``intra``) when every member is on one node, else the network
(``inter``), whose bandwidth a node shares among the rings that leave it at the same time
(``sharing``).

Example::

    >>> link = Link(alpha=1e-5, beta=1e11)
    >>> round(all_reduce_time(4, 1e9, link, algorithm="ring") * 1e3, 3)
    15.06
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from ssdsl.cost.profiles import Cluster, DeviceProfile


@attrs.frozen
class Link:
    """Latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s) of one hop; ``exchange_bytes``
    and ``exchange_alpha`` (None: ``alpha``): the profile's bound and fixed cost per round of
    all-reduces by exchanges (0 bytes: none runs so)."""

    alpha: float
    beta: float
    exchange_bytes: float = 0.0
    exchange_alpha: float | None = None


def link_for(devices: Iterable[int], profile: DeviceProfile, cluster: Cluster, *,
             sharing: int = 1) -> Link:
    """The link a collective over ``devices`` runs at (see the module doc)."""
    if len(cluster.nodes_of(devices)) <= 1:
        return Link(profile.intra_latency, profile.intra_bw, profile.exchange_bytes,
                    profile.exchange_latency)
    return Link(profile.inter_latency, profile.inter_bw / max(1, sharing),
                profile.exchange_bytes, profile.exchange_latency)


def exchange_rounds(p: int) -> int:
    """Messages a member sends, at most, in one all-reduce by exchanges over ``p`` members:
    ``log2(p)`` rounds, and where ``p`` is no power of two one more each way to fold the extra
    members in and hand them the sum (``ssdsl.runtime.exchange`` runs exactly these).

    >>> [exchange_rounds(p) for p in (1, 2, 3, 4, 6, 8)]
    [0, 1, 3, 2, 4, 3]
    """
    low = 1 << (p.bit_length() - 1)
    return (low.bit_length() - 1) + (2 if low != p else 0)


def all_reduce_time(p: int, n: float, link: Link, *, algorithm: str = "auto") -> float:
    """All-reduce of ``n`` bytes per member over ``p`` members."""
    if p <= 1 or n <= 0:
        return 0.0
    rounds = exchange_rounds(p)
    # by exchanges over a power of two members only, as ``ssdsl.runtime.exchange.eligible``
    if algorithm == "auto" and p & (p - 1) == 0 and 0 < rounds * n <= link.exchange_bytes:
        alpha = link.alpha if link.exchange_alpha is None else link.exchange_alpha
        return rounds * (alpha + n / link.beta)
    ring = 2 * (p - 1) * (link.alpha + n / (p * link.beta))
    tree = 2 * math.ceil(math.log2(p)) * (link.alpha + n / link.beta)
    if algorithm == "ring":
        return ring
    if algorithm == "tree":
        return tree
    return min(ring, tree)


def all_gather_time(p: int, n: float, link: Link) -> float:
    """All-gather where each of ``p`` members contributes ``n`` bytes."""
    return 0.0 if p <= 1 or n <= 0 else (p - 1) * (link.alpha + n / link.beta)


def reduce_scatter_time(p: int, n: float, link: Link) -> float:
    """Reduce-scatter of ``n`` bytes per member; each keeps ``n / p``."""
    return 0.0 if p <= 1 or n <= 0 else (p - 1) * (link.alpha + n / (p * link.beta))


def all_to_all_time(p: int, n: float, link: Link) -> float:
    """All-to-all of ``n`` bytes per member, ``n / p`` to each other member."""
    return 0.0 if p <= 1 or n <= 0 else (p - 1) * (link.alpha + n / (p * link.beta))


def p2p_time(n: float, link: Link) -> float:
    """One message of ``n`` bytes."""
    return 0.0 if n <= 0 else link.alpha + n / link.beta


def collective_time(kind: str, p: int, n: float, link: Link) -> float:
    """Time of collective ``kind`` (the names of ``ssdsl.materialize.steps``) per the table."""
    if kind == "all_reduce":
        return all_reduce_time(p, n, link)
    if kind == "all_gather":
        return all_gather_time(p, n, link)
    if kind == "reduce_scatter":
        return reduce_scatter_time(p, n, link)
    if kind == "all_to_all":
        return all_to_all_time(p, n, link)
    return 0.0  # chunk, zero_split: local
