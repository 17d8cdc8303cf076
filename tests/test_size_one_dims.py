"""A selection's operator whose dim of the plan's name has size 1 (the kept dim of a
``mean(-1, keepdim=True)``) while other selected operators have it larger counts as one without
the dim, instead of refusing the plan as indivisible (a hand-written RMSNorm split along its
hidden dim, as in Hugging Face's Llama and Mistral; found by a sweep of models that are not in
the repository). Oracle: the plain model in float64 (verification's reference, ``--check``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.errors import SsdslError
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch
from tests.checked_run import assert_gloo_run_matches

MODEL = Path(__file__).resolve().parent / "models" / "hand_rms_norm.py"
PLAN = """plan norm_hidden()
partition {what} along d2 into 2
replicate rest into 2
assign each part i to device i
"""


def _plan(tmp_path: Path, what: str) -> Path:
    path = tmp_path / "norm_hidden.ssp"
    path.write_text(PLAN.format(what=what))
    return path


@pytest.mark.parametrize("what", ["norm", "layers.* | norm"])
def test_a_norm_split_along_its_hidden_dim_is_verified(tmp_path, what):
    got = verify_before_launch(JobSpec(str(MODEL), str(_plan(tmp_path, what))), 2)
    assert got.status == "verified", got.reason
    assert got.loss == pytest.approx(got.reference_loss, rel=1e-12, abs=0)


def test_a_selection_whose_dim_is_one_everywhere_is_still_refused(tmp_path):
    plan = _plan(tmp_path, "norm & kind(add, rsqrt)")  # the eps add and its rsqrt: 4x8x1
    with pytest.raises(SsdslError) as info:
        verify_before_launch(JobSpec(str(MODEL), str(plan)), 2)
    assert type(info.value).__name__ == "IndivisibleError"
    assert "size 1" in info.value.message and info.value.span.line == 2


@pytest.mark.slow  # two rank processes
def test_gloo_run_matches_the_plain_model(tmp_path, capsys):
    assert_gloo_run_matches(capsys, MODEL, str(_plan(tmp_path, "norm")), 2)
