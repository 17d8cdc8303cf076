"""The plain model of a check raising where its traced graph does not (an operator with no
float64 kernel on this device, as transformers' MoE ``grouped_mm``): a located error at the
model file's line, exit 2, no traceback; verification falls back to the run's dtype instead of
blaming the simulator. The oracle of the float32 case is the plain model itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.cli import main
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from ssdsl.runtime.reference import run_reference
from ssdsl.trace.model_file import PlainModelRaised, load_model_file

MODEL = Path(__file__).resolve().parent / "models" / "no_float64_kernel.py"
RAISING_LINE = next(i for i, line in enumerate(MODEL.read_text().splitlines(), 1)
                    if "raise RuntimeError" in line)


def test_the_reference_raising_is_located_in_the_model_file():
    with pytest.raises(PlainModelRaised) as info:
        run_reference(load_model_file(str(MODEL)), steps=1, dtype=torch.float64)
    err = info.value
    assert err.span is not None and err.span.line == RAISING_LINE
    assert "float64" in err.message and "no float64 kernel" in err.message
    assert "--dtype" in err.hint


def test_a_float32_run_is_verified_in_float32_when_float64_cannot_run():
    v = verify_before_launch(JobSpec(str(MODEL), "dp"), 2)
    assert v.verified and v.dtype == "float32", v
    assert abs(v.loss - v.reference_loss) <= 1e-6 * abs(v.reference_loss)


def test_a_float64_run_says_the_plain_model_cannot_run():
    v = verify_before_launch(JobSpec(str(MODEL), "dp", dtype="float64"), 2)
    assert not v.verified
    assert "plain model" in v.reason and "simulator" not in v.reason


@pytest.mark.slow
def test_check_in_float64_stops_with_exit_2_and_no_traceback(capsys):
    code = main(["run", str(MODEL), "dp", "--nproc", "2", "--steps", "1", "--check",
                 "--dtype", "float64", "--optimizer", "sgd"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert f"no_float64_kernel.py:{RAISING_LINE}:" in err
