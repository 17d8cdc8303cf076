"""``x[arange(N)[:, None, None], j]`` over the whole of x's dim 0 is traced as an aligned dim
(finding 4 of issue 10): the batch flows through it, the arange is gone, the graph still computes
the model's loss and gradients (oracle: the model itself), and the batch splits into
micro-batches and data-parallel parts that match the plain model."""

from __future__ import annotations

from pathlib import Path

import torch

from ssdsl.elaborate import elaborate_file
from ssdsl.ir.interpret import run_graph
from ssdsl.materialize.program import materialize
from ssdsl.runtime.verify import verify_plan
from ssdsl.schedule.resolve import resolve_pipeline
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import transform

MODEL = Path(__file__).resolve().parent / "models" / "arange_mask.py"


def _traced():
    mf = load_model_file(MODEL)
    model = mf.build(seed=0).double()
    return mf, model, trace(mf, device="cpu", model=model)


def test_no_lookup_by_a_batch_arange_remains() -> None:
    _, _, graph = _traced()
    batch = graph.tensors[graph.inputs[0]].shape[0]
    assert not [op for op in graph.ops if op.kind == "arange" and op.args[:1] == (batch,)]
    for op in graph.ops:
        if op.kind == "index":
            assert graph.tensors[op.outputs[0]].dim_names[0] == "batch"


def test_graph_equals_the_model() -> None:
    mf, model, graph = _traced()
    inputs, target = mf.get_batch(0)
    want = mf.loss(model(*inputs), target)
    want.backward()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    got = run_graph(graph, params, (*inputs, target))
    got.backward()
    assert abs(float(got) - float(want)) < 1e-12
    for n, p in model.named_parameters():
        assert torch.allclose(params[n].grad, p.grad, atol=1e-12), n


def test_splits_along_the_batch() -> None:
    mf, _, graph = _traced()
    resolve_pipeline(transform(graph, elaborate_file("1f1b", world=2,
                                                     sets={"microbatches": "4"})))
    m = materialize(transform(graph, elaborate_file("dp", world=2)), dtype=torch.float64)
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]


ROW_PICK = Path(__file__).resolve().parent / "models" / "row_pick.py"


def _row_pick():
    mf = load_model_file(ROW_PICK)
    model = mf.build(seed=0).double()
    return mf, model, trace(mf, device="cpu", model=model)


def test_row_pick_by_a_batch_arange_is_a_gather_along_the_batch() -> None:
    """``h[arange(B), last]`` (a sequence classifier's pooling): once a lookup of the whole
    batch, so data parallelism gathered ``h`` and micro-batches were refused."""
    mf, model, graph = _row_pick()
    batch = graph.tensors[graph.inputs[0]].shape[0]
    assert not [op for op in graph.ops if op.kind == "arange"]
    (gather,) = [op for op in graph.ops if op.kind == "gather"]
    assert graph.tensors[gather.outputs[0]].dim_names[0] == "batch"
    assert graph.tensors[gather.outputs[0]].shape[0] == batch
    inputs, target = mf.get_batch(0)
    want = mf.loss(model(*inputs), target)
    want.backward()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    got = run_graph(graph, params, (*inputs, target))
    got.backward()
    assert abs(float(got) - float(want)) < 1e-12
    for n, p in model.named_parameters():
        assert torch.allclose(params[n].grad, p.grad, atol=1e-12), n


def test_row_pick_splits_along_the_batch_without_gathering() -> None:
    mf, _, graph = _row_pick()
    resolve_pipeline(transform(graph, elaborate_file("1f1b", world=2,
                                                     sets={"microbatches": "2"})))
    m = materialize(transform(graph, elaborate_file("dp", world=2)), dtype=torch.float64)
    acc = m.accounting()
    assert acc["forward"] == {} and acc["backward"] == {}
    verdict = verify_plan(m, model_file=mf)
    assert verdict.ok, verdict.problems[:5]
