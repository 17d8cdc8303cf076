"""Executor paths that need no process group: local adapters through autograd."""

import torch

from ssdsl.ir.layout import Layout
from ssdsl.materialize import plan_adapter
from ssdsl.runtime.adapters import run_adapter, simulate_adapter

S = (4, 6)


def test_identity_adapter_passes_values_and_gradients():
    p = Layout.build(S, [0, 1], d=(2, 1)).placements()
    ad = plan_adapter(S, torch.float32, p, p)
    x = torch.randn(2, 6, requires_grad=True)
    y = run_adapter(ad, 0, x)
    (y * 3).sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.full((2, 6), 3.0))
    assert run_adapter(ad, 5, x) is None  # a rank outside the adapter


def test_chunk_adapter_forward_is_local_slice():
    # R -> D is local: rank 1 runs it with no process group at all
    ad = plan_adapter(S, torch.float32, Layout.build(S, [0, 1], r=2).placements(),
                      Layout.build(S, [0, 1], d=(1, 2)).placements())
    full = torch.arange(24.0).reshape(S)
    assert torch.equal(run_adapter(ad, 1, full.clone()), full[:, 3:])
    sim = simulate_adapter(ad.backward, {0: full[:, :3], 1: full[:, 3:]})
    assert torch.equal(sim[0], full) and torch.equal(sim[1], full)
