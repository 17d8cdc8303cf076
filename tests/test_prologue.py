"""The step values computed by generated code (``ssdsl.runtime.prologue``) are the interpreter's,
and a step that uses them trains like the plain model.

Oracles: ``with_step_values`` (the IR interpreter, one ``OpOverload`` call per prologue operator:
another code path than the generated bindings) for the values themselves, exactly; the plain
single-device model in float64 with SGD (``run_reference``) for the losses and parameters of
steps run through the executor, with the loss sum of a group of one and the loss carried into a
bucket as a tensor. World 1, in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.ir.interpret import with_step_values
from ssdsl.runtime import prebuilt, prologue
from ssdsl.runtime.executor import RankProgram, assemble
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.reference import norm_scaled_errors, run_reference
from ssdsl.runtime.train import OptimizerSpec
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform.normalize import normalize_losses
from tests.test_loss_forms import FORMS, model_file

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64
DATA_DEPENDENT = ["token_mean", "masked_mean", "label_smoothing", "count"]


def _graph(path: str):
    mf = load_model_file(path)
    return mf, normalize_losses(trace(mf, device="cpu", model=mf.build(seed=0).to(F64)))


def _same(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.parametrize("form", DATA_DEPENDENT)
def test_generated_step_values_are_the_interpreters(tmp_path, form):
    mf, graph = _graph(model_file(tmp_path, form))
    assert graph.prologue, "these loss forms divide by a count the data decides"
    values = prologue.step_values_code(graph)
    assert "def values" in values.source  # written out, not the interpreter's fallback
    for step in (0, 1, 2):
        inputs, target = mf.get_batch(step, mf.batch_size)
        batch = (*inputs, target)
        _same(values(batch), with_step_values(graph, batch))


@pytest.mark.parametrize("example", ["gpt.py", "hf_llama.py"])
def test_generated_step_values_on_the_examples(example):
    mf, graph = _graph(str(ROOT / "examples" / example))
    values = prologue.step_values_code(graph)
    inputs, target = mf.get_batch(0, mf.batch_size)
    _same(values((*inputs, target)), with_step_values(graph, (*inputs, target)))


def test_a_batch_that_already_holds_its_step_values_is_given_back(tmp_path):
    mf, graph = _graph(model_file(tmp_path, "token_mean"))
    inputs, target = mf.get_batch(0, mf.batch_size)
    full = with_step_values(graph, (*inputs, target))
    got = prologue.step_values_code(graph)(full)
    assert len(got) == len(full) and all(g is f for g, f in zip(got, full))


def test_no_prologue_no_generated_code(tmp_path):
    mf, graph = _graph(model_file(tmp_path, "mean"))
    assert not graph.prologue
    values = prologue.step_values_code(graph)
    assert not hasattr(values, "source")
    inputs, target = mf.get_batch(0, mf.batch_size)
    _same(values((*inputs, target)), (*inputs, target))


def test_a_refused_binding_runs_the_interpreter_instead(tmp_path, monkeypatch):
    """A binding that raises (as one that refuses its arguments does) leaves the step to the
    interpreter, which computes the same values."""
    mf, graph = _graph(model_file(tmp_path, "token_mean"))
    calls = []

    def refusing(overload):
        def binding(*args, **kwargs):
            calls.append(overload)
            raise TypeError("refused")
        return binding
    monkeypatch.setattr(prebuilt, "fast_binding", refusing)
    values = prologue.step_values_code(graph)
    inputs, target = mf.get_batch(0, mf.batch_size)
    _same(values((*inputs, target)), with_step_values(graph, (*inputs, target)))
    assert calls, "the generated code was tried first"


def test_the_lever_off_runs_the_interpreter(tmp_path, monkeypatch):
    """``ENABLED`` is read at every call: off, the generated code is not entered."""
    mf, graph = _graph(model_file(tmp_path, "token_mean"))
    calls = []

    def recording(overload):
        def binding(*args, **kwargs):
            calls.append(overload)
            return overload(*args, **kwargs)
        return binding
    monkeypatch.setattr(prebuilt, "fast_binding", recording)
    values = prologue.step_values_code(graph)
    inputs, target = mf.get_batch(1, mf.batch_size)
    monkeypatch.setattr(prologue, "ENABLED", False)
    _same(values((*inputs, target)), with_step_values(graph, (*inputs, target)))
    assert not calls
    monkeypatch.setattr(prologue, "ENABLED", True)
    _same(values((*inputs, target)), with_step_values(graph, (*inputs, target)))
    assert len(calls) == len(graph.prologue)


CASES = {
    # a loss sum over a group of one: no collective, the rank's share is the loss
    "gpt_dp": ("gpt.py", "dp", ()),
    # four loss parts, added in float64 into the step's loss
    "gpt_1f1b_mb4": ("gpt.py", "1f1b", (("stages", "1"), ("microbatches", "4"))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_through_the_executor_match_the_plain_model(case):
    model, plan, sets = CASES[case]
    spec = JobSpec(str(ROOT / "examples" / model), plan, sets, dtype="float64", optimizer="sgd",
                   lr=0.1)
    mf, m, full = plan_job(spec, 1)
    assert m.transformed.graph.prologue
    prog = RankProgram(m, 0, mf, full, dtype=F64, optimizer=OptimizerSpec("sgd", 0.1),
                       groups=None)
    kinds = {ins.kind for ins in prog.program.instructions}
    assert "loss_sum" in kinds
    losses = [prog.step(s, None) for s in range(3)]
    ref = run_reference(mf, steps=3, dtype=F64, optimizer=OptimizerSpec("sgd", 0.1))
    assert all(isinstance(x, float) for x in losses)
    assert losses == pytest.approx(ref.losses, rel=1e-12, abs=0)
    final = assemble(prog.shards())
    assert max(norm_scaled_errors({k: ref.final_state[k] for k in final}, final).values()) < 1e-10


def test_the_loss_tensor_is_the_sum_of_the_parts_and_owns_its_memory():
    spec = JobSpec(str(ROOT / "examples" / "gpt.py"), "dp", (), dtype="float64",
                   optimizer="sgd", lr=0.1)
    mf, m, full = plan_job(spec, 1)
    prog = RankProgram(m, 0, mf, full, dtype=F64, optimizer=OptimizerSpec("sgd", 0.1),
                       groups=None)
    runner = prog.runner
    parts = [torch.tensor(0.1, dtype=torch.float32), torch.tensor(0.2, dtype=torch.float32),
             torch.tensor(5.0, dtype=torch.float32)]
    runner.losses = [(parts[0], True), (parts[1], True), (parts[2], False)]
    want = float(parts[0]) + float(parts[1])  # in Python floats, as _my_loss adds them
    got = runner._my_loss_tensor(torch.float64)
    assert got.shape == (1,) and got.dtype == torch.float64
    assert float(got) == want == runner._my_loss()
    runner.losses = [(parts[0], True)]
    one = runner._my_loss_tensor(torch.float32)
    one.add_(1.0)  # a collective writes into it: the loss part must not change
    assert float(parts[0]) == pytest.approx(0.1) and float(one) == pytest.approx(1.1)
    runner.losses = []
    assert float(runner._my_loss_tensor(torch.float32)) == 0.0
