"""Scatters (``scatter_add``, ``scatter``, ``scatter_reduce``) split along every dim but the one
they scatter into: a model that scatters within each row trains under micro-batches and data
parallelism like the plain model (oracle: the plain model in float64, verification's reference
and ``--check``'s). The annotation itself is checked split by split against the whole call in
``test_ops_annotations.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.preflight import verify_before_launch
from tests.checked_run import assert_gloo_run_matches

MODEL = Path(__file__).resolve().parent / "models" / "scatter_rows.py"


@pytest.mark.parametrize("plan", ["dp", "1f1b", "gpipe"])
def test_verified(plan):
    got = verify_before_launch(JobSpec(str(MODEL), plan), 2)
    assert got.status == "verified", got.reason
    assert got.loss == pytest.approx(got.reference_loss, rel=1e-12, abs=0)


def test_data_parallelism_gathers_no_activation():
    """Each rank scatters its own rows: the forward moves nothing (only gradients are summed)."""
    _, m, _ = plan_job(JobSpec(str(MODEL), "dp"), 2)
    assert m.accounting()["forward"] == {}


@pytest.mark.slow  # two rank processes
def test_a_pipeline_trains_like_the_plain_model(capsys):
    assert_gloo_run_matches(capsys, MODEL, "1f1b", 2)
