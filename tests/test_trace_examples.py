"""Tracing the example models: the IR interpreter reproduces the model's loss and gradients, every
op is annotated (or replicate-only with a reason), flowing names reach the ops a plan names, and
every op of every example splits correctly along each of its splittable dims on real activations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.ir.graph import Graph, map_tensor_refs
from ssdsl.ir.interpret import run_op
from ssdsl.ir.interpret import run_graph
from ssdsl.ops import Call, NotAnnotated, annotate, annotate_call, label_for_name
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from tests.test_ops_oracle import check_parts, equal_parts

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["mlp", "gpt", "swin", "evoformer"]
_CACHE: dict[str, tuple] = {}


def traced(name: str):
    if name not in _CACHE:
        mf = load_model_file(EXAMPLES / f"{name}.py")
        model = mf.build(seed=0)
        _CACHE[name] = (mf, model, trace(mf, device="cpu", model=model))
    return _CACHE[name]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", NAMES)
def test_interpreter_matches_model_loss_and_gradients(name: str) -> None:
    mf, model, graph = traced(name)
    inputs, target = mf.get_batch(0)
    model.zero_grad()
    ref = mf.loss(model(*inputs), target)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone().requires_grad_(n in ref_grads)
              for n, p in _state(model).items()}
    got = run_graph(graph, params, (*inputs, target))
    got.backward()
    assert torch.allclose(got, ref.detach(), rtol=1e-6, atol=1e-6)
    for n, g in ref_grads.items():
        scale = g.norm().item() + 1e-12
        assert (params[n].grad - g).norm().item() / scale < 1e-5, n


@pytest.mark.parametrize("name", NAMES)
def test_every_op_is_annotated(name: str) -> None:
    _, _, graph = traced(name)
    missing = [(op.name, op.target, a.reason) for op in graph.ops
               if isinstance(a := annotate(graph, op), NotAnnotated)]
    assert not missing


def test_gpt_flowing_names_and_fused_qkv() -> None:
    _, _, graph = traced("gpt")
    qkv = next(op for op in graph.ops if op.module == "h.0.attn.c_attn")
    w = graph.tensors[qkv.inputs[1]]
    assert [f.name for f in w.factors[0]] == [None, "heads", None]
    ann, label = label_for_name(graph, qkv, "heads")
    call = Call(qkv, graph.tensors)
    part = ann.split(call, label, 2, 1)
    # rows of heads 2..3 in each of the q, k and v blocks of 32 rows
    assert part.inputs[1][0] == ((16, 32), (48, 64), (80, 96))
    sdpa = next(op for op in graph.ops if op.kind == "sdpa")
    assert label_for_name(graph, sdpa, "heads") is not None
    assert label_for_name(graph, sdpa, "batch") is not None
    loss = graph.ops[-1]
    ann = annotate(graph, loss)
    # a mean over labelled tokens: its divisor is the data's, so the traced op does not split;
    # the transform rewrites it as a sum (ssdsl.transform.normalize), whose batch is reduced
    label = ann.label_for("batch")
    assert label and ann.labels()[label].mark == "frozen"
    assert "count of targets" in ann.labels()[label].reason
    assert graph.tensors[graph.inputs[0]].dim_names == ("batch", "seq")
    # the tied lm_head is one parameter: one graph tensor, its other name an alias
    assert graph.aliases == {"wte.weight": ("lm_head.weight",)}
    assert list(graph.params.values()).count("wte.weight") == 1
    assert "lm_head.weight" not in graph.params.values()


def test_module_paths_and_qualified_names() -> None:
    _, model, graph = traced("gpt")
    assert {op.module for op in graph.ops} >= {"h.0.attn.c_attn", "h.1.mlp.c_proj", "ln_f"}
    names = set(graph.params.values())
    for q in names:
        assert q in dict(model.named_parameters(remove_duplicate=False))


def _values(graph: Graph, mf, model) -> dict[str, torch.Tensor]:
    inputs, target = mf.get_batch(0)
    env = dict(zip(graph.inputs, (*inputs, target)))
    for t, q in {**graph.params, **graph.buffers}.items():
        env[t] = _state(model)[q] if q in _state(model) else _state(model)[graph.aliases[q][0]]
    env.update(graph.constants)
    with torch.no_grad():
        for op in graph.ops:
            env.update(zip(op.outputs, run_op(op, env)))
    return {k: v.double() if v.is_floating_point() else v for k, v in env.items()}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in ("swin", "evoformer") else n for n in NAMES])
def test_every_op_splits_on_real_activations(name: str) -> None:
    mf, model, graph = traced(name)
    values = _values(graph, mf, model)
    seen = set()
    for op in graph.ops:
        key = (op.target, repr(map_tensor_refs(op.args, lambda r: graph.tensors[r.name].shape)),
               op.kwargs)
        if key in seen:
            continue
        seen.add(key)
        call = Call(op, graph.tensors)
        vals = {t: values[t] for t in op.inputs}
        # the op's own labels, and the finer factors that carry a flowing name (heads in 3C)
        raw, ann = annotate_call(call), annotate(graph, op)
        cases = [(raw, lab) for lab in raw.splittable()]
        cases += [(ann, lab) for lab in ann.splittable() if "." in lab and lab in ann.names]
        for a, label in cases:
            if a.sizes()[label] % 2 == 0:
                check_parts(call, a, vals, equal_parts(a, label, 2), atol=1e-8)


def test_gpt_traces_on_meta_without_memory() -> None:
    mf = load_model_file(EXAMPLES / "gpt.py")
    graph = trace(mf, device="meta")
    assert graph.tensors[graph.output].shape == ()
    assert any(op.kind == "sdpa" for op in graph.ops)
