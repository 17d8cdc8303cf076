"""The rank's program as generated straight-line code (``ssdsl.runtime.straight``) trains like
the plain model and exactly like the loop of handlers it replaces.

Oracles: the single-device reference (``run_reference``, float64, SGD) for losses and final
parameters; and, for bit-for-bit equality, the same program run by ``Runner.run``'s loop of
handlers (``straight.ENABLED = False``), which calls every instruction through its handler
instead of through written code. World 1 in this process: no process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime import straight
from ssdsl.runtime.executor import DistRunner, RankProgram, assemble
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.reference import run_reference
from ssdsl.runtime.train import OptimizerSpec

ROOT = Path(__file__).resolve().parent.parent
LR, STEPS = 0.1, 2
CASES = {
    "gpt_dp": ("gpt.py", "dp", ()),
    # recomputed regions: the instructions between recompute and its end go through visit
    "gpt_coshard": ("gpt.py", "coshard", (("colocate", "2"),)),
    "gpt_1f1b": ("gpt.py", "1f1b", (("stages", "1"), ("microbatches", "2"))),
    # forward-only passes (units without grad) and cuts
    "evoformer_recycle": ("evoformer_recycle.py", "recycle_1f1b", (("stages", "1"),)),
    "swin_dp": ("swin.py", "dp", ()),  # buffers, layer norms, windows
}


def _planned(case: str):
    model, plan, sets = CASES[case]
    spec = JobSpec(str(ROOT / "examples" / model), plan, sets, dtype="float64",
                   optimizer="sgd", lr=LR)
    return plan_job(spec, 1)


def _program(planned, runner_cls=None) -> RankProgram:
    mf, m, full = planned
    prog = RankProgram(m, 0, mf, full, dtype=torch.float64, optimizer=OptimizerSpec("sgd", LR),
                       groups=None)
    if runner_cls is not None:
        prog.runner.__class__ = runner_cls
    return prog


def _train(prog: RankProgram) -> tuple[list[float], list[torch.Tensor]]:
    losses, grads = [], []
    for step in range(STEPS):
        losses.append(prog.step(step, None))
        grads += [leaf.grad.clone() for leaf in prog.state.leaves.values()
                  if leaf.grad is not None]
    return losses, grads


def _source(prog: RankProgram) -> str:
    (_program_, run), = prog.runner._generated.values()
    return run.source


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return request.param, _planned(request.param)


def test_straight_code_trains_like_the_plain_model(case):
    name, planned = case
    prog = _program(planned)
    losses, _ = _train(prog)
    assert "try:" in _source(prog)  # calls were written inline (else this tests the loop)
    ref = run_reference(planned[0], steps=STEPS, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd", LR))
    assert losses == pytest.approx(list(ref.losses), rel=1e-10)
    got = assemble(prog.shards())
    assert set(got) == set(ref.final_state)
    for qual, t in got.items():
        assert torch.allclose(t, ref.final_state[qual], rtol=1e-10, atol=1e-12), (name, qual)


def test_straight_code_is_the_loop_of_handlers_bit_for_bit(case, monkeypatch):
    _name, planned = case
    fast = _train(_program(planned))
    monkeypatch.setattr(straight, "ENABLED", False)
    loop_prog = _program(planned)
    loop = _train(loop_prog)
    assert not loop_prog.runner._generated
    assert fast[0] == loop[0]
    assert len(fast[1]) == len(loop[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(fast[1], loop[1]))


def test_forward_only_and_recomputed_cases_exercise_the_visit_branch():
    """The cases above include what makes ``fast`` false: a unit without grad, a region."""
    kinds = {}
    for name in ("evoformer_recycle", "gpt_coshard"):
        prog = _program(_planned(name))
        kinds[name] = [(i.kind, getattr(i, "grad", True)) for i in prog.program.instructions]
    assert ("begin", False) in kinds["evoformer_recycle"]
    assert any(k == "recompute" for k, _ in kinds["gpt_coshard"])


class _CountingRunner(DistRunner):
    calls = 0

    def on_call(self, ins) -> None:
        type(self).calls += 1
        super().on_call(ins)


def test_a_runner_that_overrides_a_handler_gets_it_for_every_instruction_of_its_kind():
    planned = _planned("gpt_dp")
    prog = _program(planned, _CountingRunner)
    _CountingRunner.calls = 0
    losses, _ = _train(prog)
    calls = sum(1 for i in prog.program.instructions if i.kind == "call")
    assert _CountingRunner.calls == STEPS * calls
    assert "try:" not in _source(prog)  # no call written inline
    ref = run_reference(planned[0], steps=STEPS, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd", LR))
    assert losses == pytest.approx(list(ref.losses), rel=1e-10)


def test_a_call_that_raises_is_run_by_the_ordinary_handler(monkeypatch):
    """A generated call that raises hands the instruction to ``on_call``, as the prebuilt
    closure does: here every inline ``layer_norm`` raises, and the step is still right."""
    real = straight.call_parts

    def refusing(runner, ins):
        parts = real(runner, ins)
        if parts is None or "layer_norm" not in str(ins.call.target):
            return parts

        def refuse(*_args, **_kwargs):
            raise RuntimeError("refused")
        return refuse, parts[1], parts[2]

    monkeypatch.setattr(straight, "call_parts", refusing)
    planned = _planned("gpt_dp")
    prog = _program(planned)
    losses, _ = _train(prog)
    assert "layer_norm" in str([i.call.target for i in prog.program.instructions
                                if i.kind == "call"])
    ref = run_reference(planned[0], steps=STEPS, dtype=torch.float64,
                        optimizer=OptimizerSpec("sgd", LR))
    assert losses == pytest.approx(list(ref.losses), rel=1e-10)


@pytest.mark.parametrize("generated", [True, False])
def test_a_batch_of_another_shape_is_refused_as_the_handler_refuses_it(generated, monkeypatch):
    """A batch input written inline takes its rows only from a batch of the plan's shape; any
    other goes to ``on_input``, which names the shapes (the loop of handlers raises the same)."""
    monkeypatch.setattr(straight, "ENABLED", generated)
    mf, m, full = _planned("gpt_1f1b")
    prog = _program((mf, m, full))
    inputs, target = mf.get_batch(0, None)
    prog.train_batch((*inputs, target))  # the plan's shape: trains
    if generated:
        assert "R.batch[" in _source(prog)  # the rows are taken inline
    with pytest.raises(ValueError, match=r"local tensor of shape \(3, "):
        prog.train_batch((*(t[:3] for t in inputs), target[:3]))
