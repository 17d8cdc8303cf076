"""Verification before launch (issue 17): one simulated step of all ranks against the plain
model, the batch called twice, random operators refused; never silent when it cannot verify.

The faults are injected into a correct plan's materialized adapters and reducer (what a wrong
rule of ssdsl would produce), so these tests keep failing plans to catch after every fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from ssdsl.cli import main
from ssdsl.runtime import preflight
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.preflight import (NonDeterministicBatch, RandomOperator, TrainsDifferently,
                                     verify_before_launch)

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")
GPT = str(ROOT / "examples" / "gpt.py")
MODELS = ROOT / "tests" / "models"


def test_correct_plan_is_verified_in_float64():
    v = verify_before_launch(JobSpec(MLP, "dp"), 2)
    assert v.verified and v.dtype == "float64"
    assert abs(v.loss - v.reference_loss) < 1e-12 and v.max_grad_error < 1e-12


@pytest.mark.slow
def test_tensor_parallel_gpt_is_verified():
    v = verify_before_launch(JobSpec(GPT, "megatron_tp", (("tp", "2"),)), 2)
    assert v.verified and v.max_grad_error < 1e-12


def test_dropout_is_refused():
    with pytest.raises(RandomOperator) as info:
        verify_before_launch(JobSpec(str(MODELS / "dropout_mlp.py"), "dp"), 2)
    assert "dropout" in info.value.message and info.value.file.endswith("dropout_mlp.py")


def test_unseeded_get_batch_is_refused():
    with pytest.raises(NonDeterministicBatch):
        verify_before_launch(JobSpec(str(MODELS / "unseeded_batch.py"), "dp"), 2)


def _inject(monkeypatch, fault):
    def planned(spec, world, *, model_file=None):
        mf, m, model = plan_job(spec, world, model_file=model_file)
        return mf, fault(m), model
    monkeypatch.setattr(preflight, "plan_job", planned)


def test_a_dropped_all_reduce_is_located_at_its_consumer(monkeypatch):
    broken: list = []

    def drop_all_reduce(m):
        key, edge = next((k, e) for k, e in m.edges.items() if e.adapter.kinds == ("all_reduce",))
        broken.append((key, m.transformed.parts[key[1]][0].span))
        wrong = attrs.evolve(edge, adapter=attrs.evolve(edge.adapter, steps=()))
        return attrs.evolve(m, edges={**m.edges, key: wrong})

    _inject(monkeypatch, drop_all_reduce)
    with pytest.raises(TrainsDifferently) as info:
        verify_before_launch(JobSpec(GPT, "megatron_tp", (("tp", "2"),)), 2)
    (tensor, consumer, _), span = broken[0]
    assert f"operator '{consumer}'" in info.value.message
    assert info.value.span == span and span is not None


def test_a_fault_inside_a_pipeline_is_located_with_its_micro_batch(monkeypatch):
    """The locator reads the simulated programs' own values, so a plan with stages and
    micro-batches is located like any other (the oracle: the plain model's forward)."""
    broken: list = []

    def drop_all_reduce(m):
        key, edge = next((k, e) for k, e in m.edges.items() if e.adapter.kinds == ("all_reduce",))
        broken.append((key, m.transformed.parts[key[1]][0].span))
        wrong = attrs.evolve(edge, adapter=attrs.evolve(edge.adapter, steps=()))
        return attrs.evolve(m, edges={**m.edges, key: wrong})

    _inject(monkeypatch, drop_all_reduce)
    with pytest.raises(TrainsDifferently) as info:
        verify_before_launch(JobSpec(GPT, "dp_tp_1f1b", (("dp", "1"), ("tp", "2"), ("pp", "2"),
                                                         ("microbatches", "2"))), 4)
    (tensor, consumer, _), span = broken[0]
    assert f"operator '{consumer}'" in info.value.message
    assert "micro-batch 0" in info.value.message
    assert info.value.span == span and span is not None


def test_a_dropped_gradient_reduction_names_the_weight(monkeypatch):
    _inject(monkeypatch, lambda m: attrs.evolve(m, reducer=attrs.evolve(m.reducer, buckets=())))
    with pytest.raises(TrainsDifferently) as info:
        verify_before_launch(JobSpec(MLP, "dp"), 2)
    assert "gradients part" in info.value.message and "weight" in info.value.message
    assert info.value.span is not None


def _planned(spec, world):
    from ssdsl.runtime.job import launch_files
    with launch_files(spec, world) as planned:  # the launcher's plan, in the run's float32
        return planned.m


def test_the_launchers_own_programs_are_simulated_in_float64_without_planning_again(monkeypatch):
    """Verification runs the very programs the ranks will run (planned from the float32 trace),
    in float64; it does not trace or plan a second time."""
    spec = JobSpec(GPT, "megatron_tp", (("tp", "2"),))
    m = _planned(spec, 2)
    plans: list = []
    monkeypatch.setattr(preflight, "plan_job", lambda *a, **k: plans.append(a) or plan_job(*a, **k))
    v = verify_before_launch(spec, 2, planned=m)
    assert v.verified and v.dtype == "float64" and v.max_grad_error < 1e-12
    assert plans == [] and str(m.dtype) == "torch.float32"


def test_a_model_that_computes_otherwise_in_float64_is_verified_by_a_float64_plan(monkeypatch):
    """``torch.finfo(x.dtype).eps`` is float32's in the float32 trace and float64's in the
    float64 model: the float32 programs run in float64 part from the plain float64 model by
    1e-7, which is the model's doing, not the plan's; a float64 plan agrees, so it is verified
    (not refused), and its programs, run in float32, agree with the float32 model too."""
    spec = JobSpec(str(MODELS / "finfo_eps.py"), "dp")
    m = _planned(spec, 2)
    plans: list = []
    monkeypatch.setattr(preflight, "plan_job", lambda *a, **k: plans.append(a[0].dtype) or
                        plan_job(*a, **k))
    v = verify_before_launch(spec, 2, planned=m)
    assert v.verified and v.dtype == "float32" and plans == ["float64"]


def test_programs_wrong_only_in_the_run_dtype_are_refused():
    """The verdict is on the programs that run: a fault in the launcher's float32 plan is
    refused even though a float64 plan made afresh is right."""
    spec = JobSpec(GPT, "megatron_tp", (("tp", "2"),))
    m = _planned(spec, 2)
    key, edge = next((k, e) for k, e in m.edges.items() if e.adapter.kinds == ("all_reduce",))
    wrong = attrs.evolve(m, edges={**m.edges, key: attrs.evolve(
        edge, adapter=attrs.evolve(edge.adapter, steps=()))})
    with pytest.raises(TrainsDifferently) as info:
        verify_before_launch(spec, 2, planned=wrong)
    assert f"operator '{key[1]}'" in info.value.message and info.value.span is not None


def test_too_large_to_simulate_says_so():
    v = verify_before_launch(JobSpec(MLP, "dp"), 2, available_bytes=1024)
    assert v.status == "not verified" and "too large" in v.reason


def test_a_plan_the_simulator_cannot_run_says_why():
    v = verify_before_launch(JobSpec(MLP, "1f1b", (("microbatches", "2"),)), 2)
    assert v.verified or (v.status == "not verified" and v.reason)


def test_skipped_says_so():
    v = verify_before_launch(JobSpec(MLP, "dp"), 2, enabled=False)
    assert v.status == "skipped" and "NOT verified" in v.line()


def test_run_stops_before_launch_with_exit_2(capsys):
    assert main(["run", str(MODELS / "dropout_mlp.py"), "dp", "--nproc", "2"]) == 2
    assert "random" in capsys.readouterr().err


@pytest.mark.slow
def test_run_reports_verification(capsys):
    code = main(["run", MLP, "dp", "--nproc", "2", "--steps", "1", "--json"])
    captured = capsys.readouterr()
    verify = json.loads(captured.out)["verify"]
    assert code == 0 and verify["status"] == "verified"
    assert verify["held_ranks_s"] >= 0.0 and verify["seconds"] > 0.0
    assert "verified before launch" in captured.err
    code = main(["run", MLP, "dp", "--nproc", "2", "--steps", "1", "--no-verify"])
    assert code == 0 and "NOT verified" in capsys.readouterr().err


@pytest.mark.slow
def test_run_verifies_while_the_ranks_start_and_none_trains_a_wrong_plan(monkeypatch, capsys):
    """``ssdsl run`` starts the ranks while it verifies; they wait at the gate before their
    first step. A plan that fails verification (the bias rule undone in the launcher, so its
    plan adds the bias in every part) exits 2 at its plan line, and no rank took a step."""
    import ssdsl.ops.matmul as matmul
    monkeypatch.setattr(matmul, "first_value_part", lambda ann, ranges: True)
    code = main(["run", GPT, "megatron_tp", "--nproc", "2", "--steps", "2", "--set", "tp=2"])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "differs from the plain model" in err and "megatron_tp.ssp:" in err
    assert "step 1/2" not in out and "trained" not in out


FLOOR_MODEL = '''
import torch
from torch import nn
BATCH_SIZE = 4


class Floored(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        s = self.lin(x)
        return torch.maximum(s, torch.full((), torch.finfo(s.dtype).min))  # no dtype: float32


def build_model():
    return Floored()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch_size, 8, generator=g),), torch.randint(0, 8, (batch_size,),
                                                                     generator=g)
'''


def test_a_model_that_does_not_train_in_the_runs_dtype_is_refused_at_its_line(tmp_path):
    """HF XGLM's pattern: ``torch.full((), finfo(x.dtype).min)`` without a dtype overflows
    float32 when x is float64. The plain model itself raises then (oracle: eager, below), so
    the ranks would too: the launch is refused at the model's line, not blamed on the simulator
    and left to fail in the ranks; in float32 the same file verifies."""
    import torch

    from ssdsl.trace.model_file import PlainModelRaised, load_model_file
    path = tmp_path / "floored.py"
    path.write_text(FLOOR_MODEL)
    model = load_model_file(str(path)).build(seed=0).double()
    with pytest.raises(RuntimeError, match="overflow"):
        model(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(PlainModelRaised) as info:
        verify_before_launch(JobSpec(str(path), "dp", dtype="float64"), 1)
    err = info.value
    assert "does not train in float64" in err.message and "overflow" in err.message
    assert err.span is not None and "torch.full" in FLOOR_MODEL.splitlines()[err.span.line - 1]
    assert verify_before_launch(JobSpec(str(path), "dp"), 1).verified
