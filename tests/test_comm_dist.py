"""Real collectives on gloo (4 ranks, spawned): adapters and primitives, forward and backward,
against values and gradients computed by slicing full tensors in one process."""

import os
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ssdsl.ir.layout import Layout
from ssdsl.ir.region import Region
from ssdsl.materialize import Weight, plan_adapter, plan_grad_reducer
from ssdsl.runtime import adapters, comm
from ssdsl.runtime.groups import ProcessGroups, groups_of

WORLD = 4
S = (8, 12)


def _lay(devs=(0, 1, 2, 3), **kw):
    return Layout.build(S, list(devs), **kw).placements()


def _adapters():
    """(name, adapter, grad contributions?) planned identically on every rank."""
    f = torch.float64
    partial = [(d, Region.full(S, (d, 4))) for d in range(4)]
    uneven = [(0, Region.box(S, [(0, 3), (0, 12)])), (0, Region.box(S, [(3, 5), (0, 12)])),
              (3, Region.box(S, [(5, 8), (0, 12)]))]
    return [
        ("all_reduce", plan_adapter(S, f, _lay(v=4), _lay(r=4)), False),
        ("all_gather", plan_adapter(S, f, _lay(d=(4, 1)), _lay(r=4)), False),
        ("all_gather/rs", plan_adapter(S, f, _lay(d=(4, 1)), _lay(r=4), grad_consumers=partial), True),
        ("chunk", plan_adapter(S, f, _lay(r=4), _lay(d=(1, 4))), False),
        ("all_to_all", plan_adapter(S, f, _lay(d=(4, 1)), _lay(d=(1, 4))), False),
        ("reduce_scatter", plan_adapter(S, f, _lay(v=4), _lay(d=(4, 1))), False),
        ("two groups", plan_adapter(S, f, _lay(v=2, d=(2, 1), devs=(3, 1, 2, 0)), _lay(r=2, d=(1, 2))), False),
        ("stage p2p", plan_adapter(S, f, _lay(devs=(0, 1), r=2), _lay(devs=(2, 3), d=(2, 1))), False),
        ("uneven", plan_adapter(S, f, uneven, _lay(devs=(1, 2), d=(1, 2))), False),
    ]


def _full(seed):
    return torch.randn(S, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_adapter(rank, name, ad, contributions, groups):
    xs_full = {p: _full(10 + i) for i, p in enumerate(sorted({r.part for _, r in ad.producers}))}
    mine = [r for d, r in ad.producers if d == rank]
    xs = [r.slice_of(xs_full[r.part]).clone().requires_grad_(True) for r in mine]
    out = adapters.run_adapter(ad, rank, xs if len(xs) != 1 else xs[0], groups=groups)
    value = sum(xs_full.values())
    cons = [r for d, r in ad.consumers if d == rank]
    outs = [] if not cons else [out] if len(cons) == 1 else list(out)
    for reg, o in zip(cons, outs):
        torch.testing.assert_close(o, reg.slice_of(value), msg=f"{name}: forward on {rank}")
    # backward: consumer on device d passes G_d (contributions) or the same G (replicas)
    grads = [reg.slice_of(_full(100 + (rank if contributions else 0))) for reg in cons]
    if outs:
        torch.autograd.backward(outs, grads)
    elif out is not None:
        torch.autograd.backward([out], [out.new_zeros(0)])
    want = sum(_full(100 + d) for d, _ in ad.consumers) if contributions else _full(100)
    for reg, x in zip(mine, xs):
        torch.testing.assert_close(x.grad, reg.slice_of(want), msg=f"{name}: grad on {rank}")


def _check_primitives(rank):
    g = (0, 1, 2, 3)
    full = _full(7)
    gfull = _full(8)
    # all-gather of row blocks, backward reduce-scatter of per-rank contributions
    x = full.chunk(4, 0)[rank].clone().requires_grad_(True)
    y = comm.all_gather(x, g, rank, dim=0)
    torch.testing.assert_close(y, full)
    (y * _full(20 + rank)).sum().backward()
    torch.testing.assert_close(x.grad, sum(_full(20 + r) for r in g).chunk(4, 0)[rank])
    # reduce-scatter with a non-ascending group order, backward all-gather
    order = (2, 0, 3, 1)
    x = _full(30 + rank).requires_grad_(True)
    y = comm.reduce_scatter(x, order, rank, dim=1)
    torch.testing.assert_close(y, sum(_full(30 + r) for r in g).chunk(4, 1)[order.index(rank)])
    (y * gfull.chunk(4, 1)[order.index(rank)]).sum().backward()
    torch.testing.assert_close(x.grad, gfull)
    # all-reduce (backward identity) and reduce_grad (backward all-reduce)
    x = _full(40 + rank).requires_grad_(True)
    y = comm.all_reduce(x, g)
    torch.testing.assert_close(y, sum(_full(40 + r) for r in g))
    (y * gfull).sum().backward()
    torch.testing.assert_close(x.grad, gfull)
    x = full.clone().requires_grad_(True)
    (comm.reduce_grad(x, g) * _full(50 + rank)).sum().backward()
    torch.testing.assert_close(x.grad, sum(_full(50 + r) for r in g))
    # chunk (backward all-gather) and all-to-all (backward the reverse)
    x = full.clone().requires_grad_(True)
    y = comm.chunk(x, g, rank, dim=1)
    torch.testing.assert_close(y, full.chunk(4, 1)[rank])
    (y * gfull.chunk(4, 1)[rank]).sum().backward()
    torch.testing.assert_close(x.grad, gfull)
    x = full.chunk(4, 0)[rank].clone().requires_grad_(True)
    y = comm.all_to_all(x, g, cat_dim=0, split_dim=1)
    torch.testing.assert_close(y, full.chunk(4, 1)[rank])
    (y * gfull.chunk(4, 1)[rank]).sum().backward()
    torch.testing.assert_close(x.grad, gfull.chunk(4, 0)[rank])
    # send (rank 0) / recv (rank 1): backward sends the gradient back
    if rank == 0:
        x = full.clone().requires_grad_(True)
        token = comm.send(x, 1)
        torch.autograd.backward([token], [token.new_empty(0)])
        torch.testing.assert_close(x.grad, 3 * full)
    elif rank == 1:
        y = comm.recv(S, 0, dtype=torch.float64)
        torch.testing.assert_close(y, full)
        (y * y * 1.5).sum().backward()


def _check_reducer(rank, groups, reducer):
    grads = {}
    for b in reducer.buckets_of(rank):
        for name, reg in b.entries:
            grads[(name, reg)] = reg.slice_of(_full(60 + rank)).clone()
    adapters.reduce_gradients(reducer, rank, grads, groups=groups)
    for b in reducer.buckets_of(rank):
        for name, reg in b.entries:
            want = reg.slice_of(sum(_full(60 + d) for d in b.devices))
            torch.testing.assert_close(grads[(name, reg)], want)


def _reducer():
    tp_rows = Layout.build(S, [0, 2, 1, 3], r=2, d=(2, 1)).placements()  # dp over {0,1} and {2,3}
    ws = [Weight("a", S, torch.float64, _lay(r=4)), Weight("b", S, torch.float64, tp_rows),
          Weight("c", S, torch.float64, _lay(d=(4, 1)))]  # c: no replica, no reduction
    return plan_grad_reducer(ws, bucket_bytes=S[0] * S[1] * 8)


def _worker(rank, port, errfile):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60))
        adapters = _adapters()
        reducer = _reducer()
        groups = ProcessGroups.create(groups_of([a for _, a, _ in adapters], [reducer]))
        for name, ad, contributions in adapters:
            _check_adapter(rank, name, ad, contributions, groups)
        _check_primitives(rank)
        _check_reducer(rank, groups, reducer)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        with open(f"{errfile}.{rank}", "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_adapters_and_primitives_on_gloo(tmp_path):
    errfile = str(tmp_path / "err")
    try:
        mp.spawn(_worker, args=(_free_port(), errfile), nprocs=WORLD, join=True)
    except Exception:
        msgs = [open(f"{errfile}.{r}").read() for r in range(WORLD) if os.path.exists(f"{errfile}.{r}")]
        pytest.fail("\n".join(msgs) or "a rank failed")


def test_reducer_plan_by_hand():
    red = _reducer()
    assert [(b.devices, [n for n, _ in b.entries]) for b in red.buckets] == [
        ((0, 1), ["b"]), ((2, 3), ["b"]), ((0, 1, 2, 3), ["a"])]
    half = S[0] * S[1] * 8 // 2
    assert red.nbytes == 2 * (2 * 1 * half) + 2 * 3 * 2 * half
    # simulated reduction equals the sum over holders
    sim = {d: {} for d in range(4)}
    for b in red.buckets:
        for d in b.devices:
            for e in b.entries:
                sim[d][e] = e[1].slice_of(_full(60 + d)).clone()
    adapters.reduce_gradients(red, 0, {}, simulate=sim)
    for b in red.buckets:
        for e in b.entries:
            for d in b.devices:
                torch.testing.assert_close(sim[d][e], e[1].slice_of(sum(_full(60 + x) for x in b.devices)))


def test_bucketing_splits_at_the_size():
    ws = [Weight(f"w{i}", (4, 4), torch.float32, _lay4()) for i in range(5)]
    red = plan_grad_reducer(ws, bucket_bytes=2 * 64)
    assert [len(b.entries) for b in red.buckets] == [2, 2, 1]


def _lay4():
    return tuple((d, Region.full((4, 4))) for d in range(4))
