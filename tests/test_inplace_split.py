"""An in-place activation after a mixing call (``nn.ReLU(inplace=True)`` after a linear) under a
split backward (a pipeline's last backward, ``zb_h1``'s I and W units): the input half keeps the
gradient of the linear's output, which the in-place op has overwritten, so the rank takes that
output's gradient edge just before the write (``Runner.on_call``, ``written_places``). Before,
the kept gradient was the activation's, without its mask, and the linear's weight gradient was
wrong (verification refused every such plan). Oracle: the plain model in float64 (verification's
reference, ``--check``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.lower import lower_plan
from ssdsl.runtime.executor import written_places
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.preflight import verify_before_launch
from tests.checked_run import assert_gloo_run_matches

MODEL = Path(__file__).resolve().parent / "models" / "inplace_act.py"


@pytest.mark.parametrize("plan", ["1f1b", "gpipe", "zb_h1"])
def test_split_backwards_are_verified(plan):
    got = verify_before_launch(JobSpec(str(MODEL), plan), 2)
    assert got.status == "verified", got.reason
    assert got.loss == pytest.approx(got.reference_loss, rel=1e-12, abs=0)


def test_only_a_written_place_is_watched():
    _, m, _ = plan_job(JobSpec(str(MODEL), "zb_h1"), 2)
    watched = [written_places(p) for p in lower_plan(m).programs]
    assert any(watched)  # the ReLU after fc2 writes fc2's output on the last stage
    _, m, _ = plan_job(JobSpec(str(MODEL), "dp"), 2)
    assert not any(written_places(p) for p in lower_plan(m).programs)  # no split backward


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("plan", ["1f1b", "zb_h1"])
def test_gloo_run_matches_the_plain_model(capsys, plan):
    assert_gloo_run_matches(capsys, MODEL, plan, 2)
