"""Verification before launch catches findings 1 and 2 of issue 10 statically (Done-when item):
the old wrong rules are put back by hand and the in-process simulation of all ranks, compared
with the plain model in float64, must refuse the plan at the plan line behind the wrong part.

- finding 1: every part of a value split adds the bias of a row-parallel ``addmm`` / ``linear``
  (HF GPT-2's ``Conv1D``), instead of part 0 only;
- finding 2: a tied parameter (gpt.py's ``wte`` / ``lm_head``) read by two operators with
  different layouts without the alias that sums its uses' gradients.

The oracle is the plain single-device model (``run_reference`` inside ``verify_before_launch``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import ssdsl.ops.matmul as matmul
import ssdsl.trace.export as export
from ssdsl.materialize.program import UnsupportedPlacement
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import TrainsDifferently, verify_before_launch

ROOT = Path(__file__).resolve().parent.parent
GPT2 = ROOT / "examples" / "hf_gpt2.py"
GPT = ROOT / "examples" / "gpt.py"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_a_bias_added_by_every_value_part_is_caught(monkeypatch) -> None:
    spec = JobSpec(str(GPT2), "megatron_tp", (("blocks", "lm.transformer.h.*"),))
    assert verify_before_launch(spec, 2).verified  # the rule as it is
    monkeypatch.setattr(matmul, "first_value_part", lambda ann, ranges: True)
    with pytest.raises(TrainsDifferently) as info:
        verify_before_launch(spec, 2)
    assert "c_proj.bias" in info.value.message
    assert info.value.span is not None and info.value.span.file.endswith("megatron_tp.ssp")


@pytest.mark.slow
def test_a_tied_parameter_without_its_summed_uses_is_caught(monkeypatch, tmp_path) -> None:
    plan = tmp_path / "tied.ssp"
    plan.write_text("plan p(n: int = world)\npartition lm_head along in into n\n"
                    "replicate rest into n\nassign each part i to device i\n")
    spec = JobSpec(str(GPT), str(plan))
    assert verify_before_launch(spec, 2).verified
    monkeypatch.setattr(export, "share_parameters", lambda ops, tensors, params, aliases, **_: ops)
    # the table read whole by the embedding and in halves by the head on one device: refused
    # while planning (no sum within a device), else caught by the simulated step
    with pytest.raises((TrainsDifferently, UnsupportedPlacement)) as info:
        verify_before_launch(spec, 2)
    if isinstance(info.value, TrainsDifferently):
        assert "lm_head.weight" in info.value.message
        assert info.value.span is not None and info.value.span.line == 3
    else:
        assert "overlapping but different regions" in info.value.message
        assert info.value.span is not None and info.value.span.line == 4
