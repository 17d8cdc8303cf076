"""Tracing a model cast to float64 (``--dtype float64``) casts the floating inputs from
``get_batch`` too (finding 5 of issue 10); integer inputs stay integers. The oracle is the plain
float64 model on the float64 batch."""

from __future__ import annotations

from pathlib import Path

import torch

from ssdsl.ir.interpret import run_graph
from ssdsl.runtime.reference import to_dtype
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_float64_model_traces_with_float64_inputs() -> None:
    mf = load_model_file(EXAMPLES / "swin.py")  # image input (float), integer labels
    model = mf.build(seed=0).to(torch.float64)
    graph = trace(mf, device="cpu", model=model)
    x, y = graph.inputs
    assert graph.tensors[x].dtype == "torch.float64"
    assert graph.tensors[y].dtype == "torch.int64"
    inputs, target = mf.get_batch(0)
    inputs = to_dtype(inputs, torch.float64)
    want = mf.loss(model(*inputs), target)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    got = run_graph(graph, params, (*inputs, target))
    assert got.dtype == torch.float64
    assert abs(float(got) - float(want)) < 1e-12
