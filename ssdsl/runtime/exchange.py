"""Sum all-reduces on gloo by pairwise exchanges (recursive doubling) where that is faster.

Gloo's ``all_reduce`` of a CPU tensor runs a ring of chunked messages whatever the size; for
the tensors a tensor-parallel layer or a small bucket reduces, its fixed costs dominate. Measured
on this project's 2-core CI machine (torch 2.13, one thread per rank; ``bench/bench_exchange.py``):

| ranks | bytes   | gloo all_reduce (wall / CPU) | exchanges (wall / CPU) |
|-------|---------|------------------------------|------------------------|
| 2     | 4 KiB   | 1.03 / 0.53 ms               | 0.16 / 0.10 ms         |
| 2     | 512 KiB | 1.96 / 1.38 ms               | 0.82 / 0.63 ms         |
| 4     | 4 KiB   | 7.12 / 2.60 ms               | 0.65 / 0.24 ms         |
| 4     | 512 KiB | 5.92 / 2.50 ms               | 2.78 / 1.20 ms         |
| 4     | 4 MiB   | 13.0 / 6.0 ms                | 14.1 / 5.7 ms          |

Recursive doubling (the short-message algorithm of MPI libraries): in round ``k`` each rank swaps
its running sum with the rank whose group position differs in bit ``k`` and adds what it got;
after ``log2(n)`` rounds every rank holds the sum. A group whose size is not a power of two first
folds its extra members into the first ones (each sends its tensor, its partner adds it) and
hands them the result at the end. Every rank sends its whole tensor each round, so the bytes a
rank moves grow as ``log2(n)`` where the ring's stay under twice the tensor: past ``MAX_BYTES``
(the tensor's bytes times the rounds) gloo's own all-reduce runs.

Each rank posts its send before its receive. The other order made the tensor-parallel step of
``bench_peers`` (16 all-reduces of 512 KiB) 6-8% slower than with gloo's all-reduce, in the
same ranks with steps alternating (``bench/bench_lever_ab.py ... megatron_tp --lever exchange``);
sending first made it 12-16% faster.

The result is the same on every member to the bit: each round, the two partners add the same
two tensors (in the other order, and IEEE addition commutes), so replicas that all-reduce their
gradients stay identical. It is not gloo's sum to the bit (another order of additions).

Only the sum of a contiguous CPU tensor over a gloo group takes this path; NCCL groups, and
everything else, call torch's collective. The messages use tag ``TAG``, which no program's
point-to-point message uses (their tags are far smaller: ``ssdsl.lower.build.tag_stride``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# False: every all-reduce is torch's (benchmarks compare)
ENABLED = True
# the most bytes a rank sends in one all-reduce by exchanges (tensor bytes x rounds)
MAX_BYTES = 4 << 20
# the tag of every exchange message (gloo tags are 32-bit; the lowering's stay far below)
TAG = 2**31 - 1

_RANKS: dict = {}  # group -> (its global ranks in group order, gloo?)


def _members(group) -> tuple[tuple[int, ...], bool]:
    got = _RANKS.get(group)
    if got is None:
        pg = group if group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(pg))
        got = _RANKS[group] = (ranks, "gloo" in str(dist.get_backend(pg)))
    return got


def _rounds(n: int) -> int:
    """Messages a rank sends, at most, in one all-reduce over ``n`` ranks."""
    p = 1 << (n.bit_length() - 1)
    return (p.bit_length() - 1) + (2 if p != n else 0)


def eligible(buf: torch.Tensor, group=None) -> bool:
    """Whether ``all_reduce(buf, group)`` runs by exchanges."""
    if not ENABLED or buf.device.type != "cpu" or not buf.is_contiguous() or buf.numel() == 0:
        return False
    ranks, gloo = _members(group)
    n = len(ranks)
    return gloo and n > 1 and buf.numel() * buf.element_size() * _rounds(n) <= MAX_BYTES


class _Pending:
    """The async all-reduce of two ranks: both messages are posted; ``wait`` adds."""

    __slots__ = ("buf", "got", "send", "recv")

    def __init__(self, buf: torch.Tensor, peer: int, group) -> None:
        self.buf, self.got = buf, torch.empty_like(buf)
        self.send = dist.isend(buf, peer, group=group, tag=TAG)
        self.recv = dist.irecv(self.got, peer, group=group, tag=TAG)

    def wait(self) -> bool:
        if self.send is not None:
            self.send.wait()  # the tensor is read by the send until then
            self.recv.wait()
            self.buf.add_(self.got)
            self.send = self.recv = self.got = None
        return True

    def is_completed(self) -> bool:
        return self.send is None


class _Done:
    __slots__ = ()

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _swap_add(buf: torch.Tensor, got: torch.Tensor, peer: int, group) -> None:
    send = dist.isend(buf, peer, group=group, tag=TAG)  # the send first: see the module's text
    recv = dist.irecv(got, peer, group=group, tag=TAG)
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


def all_reduce(buf: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``buf`` in place over ``group`` (torch's ``dist.all_reduce``, op SUM), by exchanges
    where ``eligible``; with ``async_op`` returns something to ``wait()`` on."""
    if not eligible(buf, group):
        return dist.all_reduce(buf, group=group, async_op=async_op)
    ranks, _ = _members(group)
    me = ranks.index(dist.get_rank())
    if len(ranks) == 2 and async_op:
        return _Pending(buf, ranks[1 - me], group)
    _reduce(buf, ranks, me, group)
    return _Done() if async_op else None
