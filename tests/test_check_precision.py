"""``--check`` judges with the precision the model really computes in (finding 6 of issue 10): a
model that casts its logits to float32 is compared with float32's tolerance under
``--dtype float64``, and says so; a model that computes in float64 keeps float64's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.trace.precision import computing_precision

ROOT = Path(__file__).resolve().parent.parent
F32_LOSS = ROOT / "tests" / "models" / "float32_loss.py"


def _graph(path: Path, dtype: torch.dtype):
    mf = load_model_file(path)
    return trace(mf, device="cpu", model=mf.build(seed=0).to(dtype))


def test_a_cast_to_float32_is_found_with_its_operator() -> None:
    p = computing_precision(_graph(F32_LOSS, torch.float64), torch.float64)
    assert p.dtype == torch.float32 and p.op is not None
    assert "float32" in p.note() and p.op in p.note()


def test_a_float64_model_computes_in_float64() -> None:
    p = computing_precision(_graph(ROOT / "examples" / "mlp.py", torch.float64), torch.float64)
    assert p.dtype == torch.float64 and p.note() is None


def test_a_float32_tensor_made_from_constants_does_not_lower_the_precision() -> None:
    # OPT's torch.ones mask: float32, but nothing trained is computed in it
    path = ROOT / "tests" / "models" / "float32_constant.py"
    graph = _graph(path, torch.float64)
    assert any(t.dtype == "torch.float32" for t in graph.tensors.values())  # the premise
    p = computing_precision(graph, torch.float64)
    assert p.dtype == torch.float64 and p.note() is None


def _watched(path: Path) -> torch.dtype:
    from ssdsl.runtime.verify import observed_precision
    return observed_precision(load_model_file(path), seed=0, dtype=torch.float64,
                              batch_size=None)


def test_the_running_model_tells_the_same_precision_as_its_float64_graph() -> None:
    """``observed_precision`` (the plain model run under a dispatch watch, what verification
    uses for a plan traced in float32, whose graph lost the model's own casts) agrees with the
    float64 graph's ``computing_precision`` on each kind: a cast of trained values, none, and a
    float32 tensor made from constants alone."""
    for path in (F32_LOSS, ROOT / "examples" / "mlp.py",
                 ROOT / "tests" / "models" / "float32_constant.py"):
        want = computing_precision(_graph(path, torch.float64), torch.float64).dtype
        assert _watched(path) == want, path


def test_a_float32_trace_verified_in_float64_is_judged_by_the_models_own_precision() -> None:
    """The model casts its logits to float32: the float32 trace does not show it, the plain
    float64 model does; the launcher's float32 programs, run in float64, are verified with
    float32's tolerance (their gradients differ from the model's by float32 rounding)."""
    from ssdsl.runtime.job import JobSpec, launch_files
    from ssdsl.runtime.preflight import verify_before_launch
    spec = JobSpec(str(F32_LOSS), "dp")
    with launch_files(spec, 2) as planned:
        v = verify_before_launch(spec, 2, planned=planned.m)
    assert v.verified and v.dtype == "float64" and 1e-12 < v.max_grad_error < 1e-4


@pytest.mark.slow
def test_run_check_uses_the_model_precision(capsys) -> None:
    from ssdsl.cli import main

    code = main(["run", str(F32_LOSS), "dp", "--nproc", "2", "--steps", "2", "--check",
                 "--dtype", "float64", "--optimizer", "sgd", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out["check"]
    assert "float32" in out["check_precision"]
    # the parameters still agree to float64 rounding here: the cast is after the last weight
    worst = {m["what"]: m for m in out["check"]["worst"]}
    assert worst["loss"]["tolerance"] == 1e-4 and worst["param"]["error"] < 1e-12
