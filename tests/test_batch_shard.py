"""``get_batch_shard`` (issue 14): a rank loads only the rows of the global batch its program
takes, training equals the plain model (which calls ``get_batch``), and a hook that returns other
rows than ``get_batch`` is refused before launch at its ``def`` line.

Oracles: ``get_batch`` itself (row sets), the plain model through ``--check``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.errors import SsdslError
from ssdsl.lower import lower_plan
from ssdsl.runtime.executor import input_rows
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.preflight import verify_before_launch

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "sharded_batch.py"
CE_MODEL = ROOT / "tests" / "models" / "sharded_batch_ce.py"


def test_each_data_parallel_rank_takes_its_own_rows() -> None:
    _, m, _ = plan_job(JobSpec(str(MODEL), "dp", dtype="float64"), 4)
    rows = [input_rows(p) for p in lower_plan(m).programs]
    assert rows == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_a_pipeline_stage_takes_the_rows_of_its_inputs_only() -> None:
    _, m, _ = plan_job(JobSpec(str(MODEL), "1f1b", dtype="float64"), 2)
    rows = [input_rows(p) for p in lower_plan(m).programs]
    # the first stage takes the inputs, the last the target: every row, on both
    assert rows == [(0, 8), (0, 8)]


def test_a_hook_that_returns_other_rows_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("SHARD_BUG", "1")
    with pytest.raises(SsdslError) as err:
        verify_before_launch(JobSpec(str(MODEL), "dp", dtype="float64"), 2)
    assert "get_batch_shard" in err.value.message and err.value.span is not None
    assert err.value.span.line == MODEL.read_text().splitlines().index(
        "def get_batch_shard(step: int, batch_size: int, start: int, stop: int, "
        "record: bool = True):") + 1


@pytest.mark.parametrize("plan", ["dp", "1f1b"])
def test_a_loss_counted_over_the_whole_batch_is_verified(plan) -> None:
    # cross-entropy's count of labelled targets is a step value: the ranks call get_batch
    got = verify_before_launch(JobSpec(str(CE_MODEL), plan, dtype="float64"), 2)
    assert got.status == "verified", got.reason
    assert got.loss == pytest.approx(got.reference_loss, rel=1e-12, abs=0)


@pytest.mark.slow
def test_ranks_load_only_their_rows_and_train_like_the_plain_model(capsys, tmp_path,
                                                                   monkeypatch) -> None:
    from ssdsl.cli import main
    log = tmp_path / "loaded"
    monkeypatch.setenv("SSDSL_TEST_LOADED", str(log))
    code = main(["run", str(MODEL), "dp", "--nproc", "2", "--steps", "2", "--check",
                 "--dtype", "float64", "--optimizer", "sgd", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out
    loaded = {r: (log.parent / f"loaded.{r}").read_text().split("\n")[:-1] for r in (0, 1)}
    assert loaded[0] == ["0 0 4", "1 0 4"] and loaded[1] == ["0 4 8", "1 4 8"]
