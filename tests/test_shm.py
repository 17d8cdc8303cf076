"""Point-to-point messages through shared memory between the ranks of one host
(``ssdsl.runtime.shm``), on real gloo ranks: every message arrives whole, in gloo's matching
order (by peer and tag, first in first out), whatever the order the receives are posted in;
slots are reused once read; nothing is left in ``/dev/shm``; and every rank falls back to gloo
alike. The oracle is each message regenerated from its seed on the receiving rank."""

from __future__ import annotations

import os

import pytest
import torch

from ssdsl.runtime import shm
from ssdsl.runtime.launch import launch

SHAPES = [(), (0,), (3,), (4, 5), (64, 128), (2, 3, 7)]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16]


def _message(src: int, dst: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * src + 100 * dst + k)
    shape, dtype = SHAPES[k % len(SHAPES)], DTYPES[k % len(DTYPES)]
    t = torch.randn(shape, generator=g, dtype=torch.float64) * 10
    return t.to(dtype)


def _leftovers(base: str) -> list[str]:
    name = os.path.basename(base)
    return sorted(f for f in os.listdir(shm.DIRECTORY) if f.startswith(name))


def worker(rounds: int) -> dict:
    import torch.distributed as dist

    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.groups import ProcessGroups

    with distributed(timeout_s=60) as ctx:
        n, rank = ctx.world_size, ctx.rank
        host = ProcessGroups.create([]).same_host
        assert host is not None and sorted(host.peers) == [r for r in range(n) if r != rank]
        problems: list[str] = []
        count = 12
        for rnd in range(rounds):
            # every rank sends all its messages first (non-contiguous sources among them) ...
            for dst in range(n):
                if dst == rank:
                    continue
                for k in range(count):
                    t = _message(rank, dst, k)
                    if t.dim() == 2:
                        t = t.t().contiguous().t()  # a transposed view: strided
                    host.send(t, dst, tag=k % 5)  # tags repeat: matched first in, first out
            # ... then receives them, tags posted in another order than sent
            for src in range(n):
                if src == rank:
                    continue
                want = [_message(src, rank, k) for k in range(count)]
                got: dict[int, torch.Tensor] = {}
                later = []
                for k in sorted(range(count), key=lambda k: (-(k % 5), k)):
                    buf = torch.empty(want[k].shape, dtype=want[k].dtype)
                    if k % 2:
                        later.append((k, host.irecv(buf, src, tag=k % 5)))
                    else:
                        got[k] = host.recv(buf, src, tag=k % 5)
                for k, req in later:
                    assert req.wait() and req.is_completed()
                    got[k] = req.buf
                # the n-th receive posted for a tag takes the n-th message sent with it (here
                # both in k's order within a tag), though a receive waited for at once comes
                # after one posted before it and waited for later
                for k in range(count):
                    if got[k].dtype != want[k].dtype or not torch.equal(want[k], got[k]):
                        problems.append(f"round {rnd} from {src}: message {k}")
            dist.barrier()
        left = _leftovers(host.base)  # every file unlinked once both ends hold it
        slots = host.counts["slots"]
        host.close()
        return {"problems": problems, "left": left, "slots": slots,
                "sent": host.counts["sent"], "received": host.counts["received"]}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_messages_arrive_whole_in_gloos_order_and_leave_nothing_behind(nproc):
    rounds = 3
    per_rank = launch(worker, nproc=nproc, args=(rounds,), timeout_s=300)
    for r, out in enumerate(per_rank):
        assert out["problems"] == [], (r, out["problems"])
        assert out["left"] == [], out["left"]
        assert out["sent"] == out["received"] == rounds * 12 * (nproc - 1)
        # slots are reused once read: at most one round's messages, never one per message sent
        assert out["slots"] <= 12 * (nproc - 1)


def fallback_worker() -> bool:
    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.groups import ProcessGroups

    with distributed(timeout_s=60) as ctx:
        if ctx.rank == 1:
            os.environ["SSDSL_SHM"] = "0"  # one rank may not: none does
        return ProcessGroups.create([]).same_host is None


@pytest.mark.slow
def test_one_rank_without_shared_memory_sends_everyone_through_gloo():
    assert launch(fallback_worker, nproc=2, timeout_s=120) == [True, True]


def exchange_worker() -> list[str]:
    """All-reduces by exchanges (``ssdsl.runtime.exchange``) through shared memory, on the world
    and on a group of two that shares its first round's pair of ranks with the world's. The two
    ranks of a pair issue the two all-reduces in opposite orders (gloo keeps groups apart, so
    that is allowed): one tag for both groups would hand each rank the other group's message."""
    import torch.distributed as dist

    from ssdsl.runtime import exchange
    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.groups import ProcessGroups

    with distributed(timeout_s=60) as ctx:
        n, rank = ctx.world_size, ctx.rank
        pgs = ProcessGroups.create([(0, 1), (2, 3)])
        assert pgs.same_host is not None
        real_isend = dist.isend
        dist.isend = None  # every message must go through shared memory: gloo's would fail
        problems = []
        try:
            for k in range(3):
                world = torch.full((1000,), float(rank + 1 + 10 * k))
                pair = torch.full((7,), float(100 * (rank + 1) + k))
                mine = (0, 1) if rank < 2 else (2, 3)
                if rank % 2 == 0:  # the world's first, then the pair's ...
                    work = exchange.all_reduce(world, async_op=True)
                    exchange.all_reduce(pair, group=pgs.get(mine))
                else:  # ... and the other way round on the pair's other rank
                    exchange.all_reduce(pair, group=pgs.get(mine))
                    work = exchange.all_reduce(world, async_op=True)
                work.wait()
                # oracle: the sums written by hand
                if world[0].item() != sum(r + 1 + 10 * k for r in range(n)):
                    problems.append(f"world sum {world[0].item()} at {k}")
                if pair[0].item() != sum(100 * (r + 1) + k for r in mine):
                    problems.append(f"pair sum {pair[0].item()} at {k}")
        finally:
            dist.isend = real_isend
        return problems


@pytest.mark.slow
def test_exchanges_of_two_groups_through_shared_memory_keep_apart():
    assert launch(exchange_worker, nproc=4, timeout_s=300) == [[]] * 4


def unread_worker() -> bool:
    """Rank 0 sends a message rank 1 never receives: its slot stays in ``/dev/shm``."""
    import torch.distributed as dist

    from ssdsl.runtime.dist import distributed
    from ssdsl.runtime.groups import ProcessGroups

    with distributed(timeout_s=60) as ctx:
        host = ProcessGroups.create([]).same_host
        if ctx.rank == 0:
            host.send(torch.ones(1000), 1, 7)
        dist.barrier()
        name = os.path.basename(host.base)
        return any(f.startswith(name) for f in os.listdir(shm.DIRECTORY))


@pytest.mark.slow
def test_the_launcher_sweeps_what_its_ranks_left():
    import uuid
    job = "t" + uuid.uuid4().hex[:10]
    left = launch(unread_worker, nproc=2, timeout_s=120, env={shm.JOB_VAR: job})
    assert left == [True, True]  # the unread slot was there while the ranks ran
    assert not [f for f in os.listdir(shm.DIRECTORY) if f.startswith(f"ssdsl-{job}-")]
