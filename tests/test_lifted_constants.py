"""A float tensor the forward makes from a Python number (``torch.tensor(2.5)``: torch's default
dtype, float32) keeps that dtype on the ranks under ``--dtype float64``, as ``model.to(float64)``
leaves it on one device (DeBERTa-v2's relative-position buckets; found by a sweep of models that
are not in the repository). Before, the ranks cast it to the run's dtype, so that every plan of
such a model failed verification before launch and, launched anyway, trained differently.

Oracles: the plain model cast to float64 (verification's reference and ``--check``'s), and
torch's own default dtype for the constant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssdsl.runtime.init import init_shards
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.preflight import verify_before_launch
from tests.checked_run import assert_gloo_run_matches

MODEL = Path(__file__).resolve().parent / "models" / "lifted_float_constant.py"


def test_the_constant_keeps_the_dtype_the_plain_model_gives_it():
    mf, m, model = plan_job(JobSpec(str(MODEL), "dp", dtype="float64"), 2)
    consts = [k for k, v in m.transformed.graph.constants.items() if isinstance(v, torch.Tensor)]
    assert consts, "the trace lifts the constant"
    leaves, fixed = init_shards(m, 0, model)
    got = {name: t for (name, _), t in fixed.items() if name in consts}
    assert got and all(t.dtype == torch.get_default_dtype() for t in got.values()), got
    assert all(t.dtype == torch.float64 for t in leaves.values())  # the parameters are cast


@pytest.mark.parametrize("plan", ["dp", "1f1b", "gpipe"])
def test_verification_before_launch_passes(plan):
    got = verify_before_launch(JobSpec(str(MODEL), plan), 2)
    assert got.status == "verified", got.reason
    assert got.loss == pytest.approx(got.reference_loss, rel=1e-12, abs=0)


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("plan", ["dp", "1f1b"])
def test_gloo_run_matches_the_plain_model(capsys, plan):
    assert_gloo_run_matches(capsys, MODEL, plan, 2)
