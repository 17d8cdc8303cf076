"""``grad_tensors`` remembers an operator's answer by the signature of its call (overload,
arguments, each tensor's shape, dtype and whether it needs a gradient): the layers of a deep
model run on meta once. The answers must be those of running every operator, and of autograd."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from ssdsl.ir import grad
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform.normalize import normalize_losses

ROOT = Path(__file__).resolve().parent.parent

# Three linears of one shape: the first frozen, the second fed a detached value (and again a
# value that needs a gradient), the third; a mask made from the batch alone. The shapes are the
# same each time, so only whether an input needs a gradient tells the calls apart
FROZEN = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    BATCH_SIZE = 4

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.c = nn.Linear(8, 8)
            self.a.weight.requires_grad_(False)
            self.a.bias.requires_grad_(False)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            mask = (x > 0).float()
            h = self.a(x * mask)
            h2 = self.b(h.detach() * mask)
            h3 = self.c(self.b(h2) * mask)
            return self.head(h3 + h)

    def build_model():
        return Net()

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(batch_size, 8, generator=g)
        return (x,), torch.randint(0, 3, (batch_size,), generator=g)
''')


def _models(tmp_path: Path) -> list[str]:
    frozen = tmp_path / "frozen.py"
    frozen.write_text(FROZEN)
    return [str(frozen), str(ROOT / "examples" / "gpt.py"),
            str(ROOT / "examples" / "evoformer_recycle.py"), str(ROOT / "examples" / "swin.py")]


def test_remembered_answers_are_those_of_every_operator(tmp_path):
    for path in _models(tmp_path):
        g = trace(load_model_file(path), device="meta")
        for graph in (g, normalize_losses(g)):
            assert grad._grad_tensors(graph) == grad._grad_tensors(graph, remember=False), path


def test_remembered_answers_agree_with_autograd(tmp_path):
    path = _models(tmp_path)[0]
    mf = load_model_file(path)
    g = trace(mf, device="meta")
    needs = grad._grad_tensors(g)
    model = mf.build(seed=0)
    seen: dict[str, bool] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(lambda m, a, out, name=name: None if name in seen
                                      else seen.update({name: out.requires_grad}))
    model(*mf.get_batch(0, 4)[0])
    first = {}
    for op in g.ops:
        if op.kind == "linear":
            first.setdefault(op.module, op.outputs[0])
    assert seen == {"a": False, "b": True, "c": True, "head": True}
    assert {m: first[m] in needs for m in seen} == seen
    # a's linear differs from b's only in its frozen weight; the mask needs none
    assert not any(x in needs for op in g.ops if op.kind == "gt" for x in op.outputs)


def test_alike_calls_run_on_meta_once(monkeypatch):
    g = normalize_losses(trace(load_model_file(str(ROOT / "examples" / "gpt.py")), device="meta"))
    runs = {"n": 0}
    real = grad.call_target

    def counted(*a, **k):
        runs["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(grad, "call_target", counted)
    grad._grad_tensors(g, remember=False)
    every = runs["n"]
    runs["n"] = 0
    grad._grad_tensors(g)
    assert every == len(g.ops)
    assert runs["n"] < every * 0.8, (runs["n"], every)


@pytest.mark.parametrize("shape", [(2, 3), (4, 3)])
def test_a_call_of_another_shape_runs_again(shape):
    """Two calls alike but for a shape are two signatures."""
    from ssdsl.ir.graph import TensorRef

    class Info:
        def __init__(self, shape):
            self.shape, self.dtype = shape, "torch.float32"

    op = grad.Op(name="x", target="aten.relu.default", kind="relu", module="",
                 args=(TensorRef("t"),), inputs=("t",), outputs=("y",))

    class G:
        tensors = {"t": Info(shape)}

    other = {"t": Info((shape[0] + 1, 3))}
    a = grad._signature(G, op, set(), set())
    G.tensors = other
    assert a != grad._signature(G, op, set(), set())
