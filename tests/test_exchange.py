"""All-reduces by pairwise exchanges (``ssdsl.runtime.exchange``) on real gloo ranks: the sum of
every rank's tensor (computed here from all the inputs, gathered), the same bits on every
member, in-place and async, on the world and on a group of some of its ranks."""

from __future__ import annotations

import pytest
import torch

from ssdsl.cost.collectives import exchange_rounds
from ssdsl.runtime import exchange
from ssdsl.runtime.launch import launch


def test_the_rounds_a_rank_sends_at_most():
    # a power of two: log2(n) swaps; otherwise those of the largest power of two below, and the
    # fold (an extra member's tensor in, the sum back out)
    assert [exchange_rounds(n) for n in (2, 3, 4, 5, 6, 8, 12)] == [1, 3, 2, 4, 4, 3, 5]


def _inputs(rank: int, numel: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def worker(numels: list[int], dtype_name: str) -> list[str]:
    import torch.distributed as dist

    from ssdsl.runtime.dist import distributed

    dtype = getattr(torch, dtype_name)
    problems: list[str] = []
    with distributed() as ctx:
        n, rank = ctx.world_size, ctx.rank
        # the last two ranks (or the only two) form a group of their own as well
        sub_ranks = list(range(max(0, n - 2), n))
        sub = dist.new_group(sub_ranks)
        real_all_reduce = dist.all_reduce

        def refuse(*a, **k):
            raise AssertionError("gloo's all_reduce called for an eligible tensor")

        for numel in numels:
            for where, group, members in (("world", None, list(range(n))),
                                          ("group", sub, sub_ranks)):
                if rank not in members:
                    continue
                for mode in ("sync", "async"):
                    x = _inputs(rank, numel, dtype)
                    mine = x.clone()
                    # over a group not of a power of two ranks, both are gloo's
                    eligible = exchange.eligible(x, group)
                    assert eligible == (len(members) & (len(members) - 1) == 0 and
                                        numel * x.element_size() * exchange_rounds(len(members))
                                        <= exchange.MAX_BYTES)
                    dist.all_reduce = refuse if eligible else real_all_reduce
                    try:
                        work = exchange.all_reduce(x, group=group, async_op=mode == "async")
                        if work is not None:
                            work.wait()
                    finally:
                        dist.all_reduce = real_all_reduce
                    # the oracle: every member's input, gathered, summed in float64
                    ins = [torch.empty_like(mine) for _ in members]
                    outs = [torch.empty_like(x) for _ in members]
                    dist.all_gather(ins, mine, group=group)
                    dist.all_gather(outs, x, group=group)
                    want = torch.stack([t.double() for t in ins]).sum(0)
                    tag = f"{where} {mode} numel={numel} eligible={eligible}"
                    tol = 1e-12 if dtype == torch.float64 else 1e-5
                    if not torch.allclose(x.double(), want, rtol=tol, atol=tol):
                        problems.append(f"{tag}: sum off by "
                                        f"{(x.double() - want).abs().max().item():.3g}")
                    if not all(torch.equal(outs[0], o) for o in outs):
                        problems.append(f"{tag}: members hold different bits")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_exchanges_sum_like_the_gathered_inputs_and_agree_to_the_bit(nproc):
    # 1 and 5,000 elements go by exchanges; 2 million float32 (8 MB) is past MAX_BYTES and
    # goes to gloo (the same checks hold for it)
    per_rank = launch(worker, nproc=nproc, args=([1, 5000, 2_000_000], "float32"),
                      timeout_s=600)
    assert [p for p in per_rank if p] == []


@pytest.mark.slow
def test_float64_exchanges_on_four_ranks():
    per_rank = launch(worker, nproc=4, args=([7, 4096], "float64"), timeout_s=600)
    assert [p for p in per_rank if p] == []


def early_worker(numel: int) -> float:
    """Rank 0 starts an async all-reduce, then receives a message that the last rank sends
    (blocking) before it starts its own: posting must not wait for the peers."""
    import torch.distributed as dist

    from ssdsl.runtime.dist import distributed

    with distributed(timeout_s=30) as ctx:
        n, rank = ctx.world_size, ctx.rank
        x = torch.full((numel,), float(rank + 1))
        token = torch.zeros(1)
        if rank == n - 1:
            dist.send(torch.ones(1), 0)
        work = exchange.all_reduce(x, async_op=True)
        if rank == 0:
            dist.recv(token, n - 1)
        work.wait()
        assert token.item() == (1.0 if rank == 0 else 0.0)
        return float(x[0])


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_an_async_all_reduce_waits_for_no_peer_when_it_starts(nproc):
    # the loss's all-reduce starts on a pipeline's first stage at its first unit, long before
    # the last stage can meet it (``runtime/early_loss.py``)
    got = launch(early_worker, nproc=nproc, args=(1000,), timeout_s=120)
    assert got == [float(sum(range(1, nproc + 1)))] * nproc


def mixed_worker(numel: int) -> list[float]:
    """Each member issues the same all-reduces, some async and some in place, in an order that
    differs between members (an idle rank's early loss beside a busy rank's in-place one): the
    algorithm must not depend on the mode, or the members never meet."""
    import torch.distributed as dist

    from ssdsl.runtime.dist import distributed

    with distributed(timeout_s=60) as ctx:
        rank = ctx.rank
        out = []
        for k in range(3):
            x = torch.full((numel,), float(rank + 1 + 10 * k))
            async_op = (rank + k) % 2 == 0
            work = exchange.all_reduce(x, async_op=async_op)
            if work is not None:
                work.wait()
            out.append(float(x[0]))
        dist.barrier()
        return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [3, 4])
def test_members_may_mix_async_and_in_place_all_reduces(nproc):
    # oracle: the sums written by hand
    got = launch(mixed_worker, nproc=nproc, args=(1000,), timeout_s=120)
    want = [float(sum(r + 1 + 10 * k for r in range(nproc))) for k in range(3)]
    assert got == [want] * nproc
