"""A floating tensor that needs no gradient crossing a pipeline stage boundary (issue 9).

LLaMA-style rotary tables (``cos``/``sin`` built from a buffer) are floating tensors without
gradient. A backward point-to-point planned for them has no sender: the run deadlocked while
``check`` passed. Now such a tensor gets no gradient adapter, and the run matches the plain model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssdsl.cli import main
from ssdsl.ir.grad import grad_tensors
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "tests" / "models" / "no_grad_crossing.py")


def _autograd_requires_grad(mf) -> dict[str, bool]:
    """Oracle: the plain model run on real tensors; which traced tensors autograd gives a
    grad_fn, read from forward hooks on the modules (cos from the graph's first ops)."""
    model = mf.build(seed=0)
    inputs, _ = mf.get_batch(0, mf.batch_size)
    seen: dict[str, bool] = {}
    for name, mod in model.named_modules():
        if name.endswith("fc"):
            mod.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(
                name, out.requires_grad))
    model(*inputs)
    return seen


def test_grad_tensors_agree_with_autograd():
    mf = load_model_file(MODEL)
    g = trace(mf, device="meta")
    needs = grad_tensors(g)
    by_module = {op.module: op.outputs[0] for op in g.ops if op.kind == "linear"}
    for module, requires in _autograd_requires_grad(mf).items():
        assert (by_module[module] in needs) == requires
    cos = next(op for op in g.ops if op.kind == "cos").outputs[0]
    assert cos not in needs                          # built from a buffer and positions
    assert g.output in needs


def test_no_gradient_adapter_for_tensors_without_gradient(monkeypatch):
    from ssdsl.elaborate import elaborate_file
    from ssdsl.materialize import copies
    from ssdsl.materialize.program import materialize
    from ssdsl.runtime.job import schedule_plan

    # cos needs no batch, so each stage now computes its own (tests/test_weight_copies.py);
    # with that rule off it crosses, as a value that depends on the batch would
    monkeypatch.setattr(copies, "ENABLED", False)

    mf = load_model_file(MODEL)
    g = trace(mf, device="meta")
    t, lowered = schedule_plan(g, elaborate_file("1f1b", world=2, sets={"microbatches": "2"}))
    m = materialize(t, schedule=lowered)
    crossing = {k: e for k, e in m.edges.items() if e.adapter.steps}
    cos = [e for (name, _, _), e in crossing.items() if name.startswith("cos")]
    assert cos, "the test model must send cos across the stage boundary"
    assert all(e.adapter.backward is None for e in cos)
    assert all(e.adapter.backward is not None and e.adapter.backward.steps
               for (name, _, _), e in crossing.items() if not name.startswith("cos"))


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["1f1b", "gpipe"])
def test_no_grad_crossing_runs_and_matches_reference(capsys, plan):
    code = main(["run", MODEL, plan, "--nproc", "2", "--set", "microbatches=2", "--steps", "2",
                 "--dtype", "float64", "--optimizer", "sgd", "--check", "--json",
                 "--timeout", "120"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out["check"]
    worst = {w["what"]: w["error"] for w in out["check"]["worst"]}
    assert worst["loss"] < 1e-9 and worst["param"] < 1e-9
    assert out["communication"]["forward"]["p2p"]["count"] > 0
