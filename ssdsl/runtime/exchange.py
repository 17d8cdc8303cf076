"""Sum all-reduces on gloo by pairwise exchanges (recursive doubling) where that is faster.

Gloo's ``all_reduce`` of a CPU tensor runs a ring of chunked messages whatever the size; for
the tensors a tensor-parallel layer or a small bucket reduces, its fixed costs dominate.
``bench/bench_exchange.py`` (this project's 2-core machine, torch 2.13, one thread per rank,
ranks pinned as ``ssdsl.runtime.launch`` pins them; three runs at 2 ranks, two at 4) measured
the time of an all-reduce by exchanges over gloo's:

| ranks | 4 KiB     | 512 KiB   | 1 MiB     | 4 MiB     |
|-------|-----------|-----------|-----------|-----------|
| 2     | 0.96-1.16 | 0.55-0.89 | 0.77-1.11 | 0.96-1.10 |
| 4     | 0.18-0.22 | 0.27-0.37 | 0.54-0.62 | 1.19-1.21 |

and in a training step, same ranks, steps alternating (``bench/bench_lever_ab.py MODEL PLAN
--lever exchange``) on ``bench_peers``' GPT: ``megatron_tp`` 0.84-0.88 of the step at 2 ranks
(16 all-reduces of 512 KiB) and 0.69 at 4, ``dp`` 0.96 at 2, ``1f1b`` 1.00 (nothing reduced
but the loss).

Recursive doubling (the short-message algorithm of MPI libraries): in round ``k`` each rank swaps
its running sum with the rank whose group position differs in bit ``k`` and adds what it got;
after ``log2(n)`` rounds every rank holds the sum. Only groups of a power of two ranks take
this path (``eligible``: the async and the in-place all-reduce must run the same algorithm);
``_reduce`` can fold the extra members of another size into the first ones (each sends its
tensor, its partner adds it, and gets the result back at the end), but nothing calls it so. Every rank sends its whole tensor each round, so the bytes a
rank moves grow as ``log2(n)`` where the ring's stay under twice the tensor: past ``MAX_BYTES``
(the tensor's bytes times the rounds) gloo's own all-reduce runs.

Each rank posts its send before its receive: the other order made that ``megatron_tp`` step
1.06-1.08 as long as with gloo's all-reduce.

The result is the same on every member to the bit: each round, the two partners add the same
two tensors (in the other order, and IEEE addition commutes), so replicas that all-reduce their
gradients stay identical. It is not gloo's sum to the bit (another order of additions).

Only the sum of a contiguous CPU tensor over a gloo group takes this path; NCCL groups, and
everything else, call torch's collective. Between two ranks of one host the messages go through
shared memory (``ssdsl.runtime.shm``), each group's under a tag of its own. The messages use tag ``TAG``, which no program's
point-to-point message uses (theirs stay at or below ``ssdsl.lower.instr.MAX_TAG``: the
checker's walk refuses a send beyond it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ssdsl.cost.collectives import exchange_rounds
from ssdsl.lower.instr import MAX_TAG
from ssdsl.runtime import shm

# False: every all-reduce is torch's (benchmarks compare)
ENABLED = True
# the most bytes a rank sends in one all-reduce by exchanges (tensor bytes x rounds); the CPU
# cost profile prices all-reduces as exchanges within the same bound (``exchange_bytes``)
MAX_BYTES = 4 << 20
# the tag of every exchange message: above every program's (``MAX_TAG``, which the checker's
# walk holds them to; gloo's tags are 32-bit)
TAG = MAX_TAG + 1

_RANKS: dict = {}  # process group -> (its global ranks in group order, gloo?)


def _members(group) -> tuple[tuple[int, ...], bool]:
    # keyed by the group itself, the default one included: a process that makes its process
    # group again (another world) finds a new object
    pg = group if group is not None else dist.group.WORLD
    got = _RANKS.get(pg)
    if got is None:
        ranks = tuple(dist.get_process_group_ranks(pg))
        got = _RANKS[pg] = (ranks, "gloo" in str(dist.get_backend(pg)))
    return got


def eligible(buf: torch.Tensor, group=None) -> bool:
    """Whether ``all_reduce(buf, group)`` runs by exchanges: over a gloo group of a power of
    two ranks, within ``MAX_BYTES``. Over a group of another size, the fold's first message
    blocks, which an async all-reduce must not do (the loss's starts before its peers can meet
    it); if the async one went to gloo and the in-place one by exchanges, members that issue
    the same all-reduce the two ways (an idle rank's loss, a bucket one member reduces in parts
    during its backward) would run different algorithms and never meet. Both go to gloo there:
    whether a rank waits now or later never chooses its algorithm."""
    if not ENABLED or buf.device.type != "cpu" or not buf.is_contiguous() or buf.numel() == 0:
        return False
    ranks, gloo = _members(group)
    n = len(ranks)
    return gloo and n > 1 and n & (n - 1) == 0 \
        and buf.numel() * buf.element_size() * exchange_rounds(n) <= MAX_BYTES


class _Pending:
    """An async all-reduce over a power-of-two group: the first round's messages are posted at
    once (they travel while the rank computes); ``wait`` adds what came and runs the other
    rounds (none for two ranks)."""

    __slots__ = ("buf", "got", "send", "recv", "ranks", "me", "group")

    def __init__(self, buf: torch.Tensor, ranks: tuple[int, ...], me: int, group) -> None:
        self.buf, self.got = buf, torch.empty_like(buf)
        self.ranks, self.me, self.group = ranks, me, group
        peer = ranks[me ^ 1]
        self.send, self.recv = _post(buf, self.got, peer, group)

    def wait(self) -> bool:
        if self.send is not None:
            self.send.wait()  # the tensor is read by the send until then
            self.recv.wait()
            self.buf.add_(self.got)
            bit = 2
            while bit < len(self.ranks):
                _swap_add(self.buf, self.got, self.ranks[self.me ^ bit], self.group)
                bit <<= 1
            self.send = self.recv = self.got = None
        return True

    def is_completed(self) -> bool:
        return self.send is None


def _post(buf: torch.Tensor, got: torch.Tensor, peer: int, group) -> tuple[Any, Any]:
    """Send ``buf`` to ``peer`` and receive its tensor into ``got``, the send first (see the
    module's text): through shared memory where ``peer`` shares this rank's host
    (``ssdsl.runtime.shm``, under a tag of the group's own: gloo keeps groups apart, and ranks
    may issue two groups' all-reduces in different orders), else gloo's."""
    via = shm.route(group)
    if via is not None and via[0].handles(peer, buf):
        host, number = via
        host.send(buf, peer, TAG + 1 + number)  # complete on return
        return _DONE, host.irecv(got, peer, TAG + 1 + number)
    return (dist.isend(buf, peer, group=group, tag=TAG),
            dist.irecv(got, peer, group=group, tag=TAG))


class _Done:
    """A send through shared memory: complete when issued."""

    @staticmethod
    def wait() -> bool:
        return True


_DONE = _Done()


def _swap_add(buf: torch.Tensor, got: torch.Tensor, peer: int, group) -> None:
    send, recv = _post(buf, got, peer, group)
    send.wait()
    recv.wait()
    buf.add_(got)


def _reduce(buf: torch.Tensor, ranks: tuple[int, ...], me: int, group) -> None:
    n = len(ranks)
    p = 1 << (n.bit_length() - 1)
    if me >= p:  # an extra member: its tensor goes to its partner, the sum comes back
        dist.send(buf, ranks[me - p], group=group, tag=TAG)
        dist.recv(buf, ranks[me - p], group=group, tag=TAG)
        return
    got = torch.empty_like(buf)
    if me + p < n:
        dist.recv(got, ranks[me + p], group=group, tag=TAG)
        buf.add_(got)
    bit = 1
    while bit < p:
        _swap_add(buf, got, ranks[me ^ bit], group)
        bit <<= 1
    if me + p < n:
        dist.send(buf, ranks[me + p], group=group, tag=TAG)
    # (nothing calls it over another size than a power of two, ``eligible``: the fold above
    # stays on gloo)


def all_reduce(buf: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``buf`` in place over ``group`` (torch's ``dist.all_reduce``, op SUM), by exchanges
    where ``eligible``; with ``async_op`` returns something to ``wait()`` on: over a group of a
    power of two ranks the first round is posted at once and the rest run when it is waited on
    (two ranks: nothing but the addition): posting never waits for a peer. The async and the
    in-place one exchange the same messages in the same order, so members of one all-reduce may
    mix them (``eligible``)."""
    if not eligible(buf, group):
        return dist.all_reduce(buf, group=group, async_op=async_op)
    ranks, _ = _members(group)
    if async_op:
        return _Pending(buf, ranks, ranks.index(dist.get_rank()), group)
    _reduce(buf, ranks, ranks.index(dist.get_rank()), group)
    return None
