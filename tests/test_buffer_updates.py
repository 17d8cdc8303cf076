"""A buffer the forward updates in place (a call counter, a batch norm's ``num_batches_tracked``)
is updated once a step on one device. Micro-batches run the forward once each, so a plan with
them is refused at its ``microbatch`` line, with the model line of the update; before, it was
accepted and counted micro-batches (found by a sweep of models that are not in the repository).
Oracles: the plain model (verification's reference, ``--check``) and the model's own count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.errors import SsdslError
from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import verify_before_launch

MODEL = Path(__file__).resolve().parent / "models" / "buffer_counter.py"


@pytest.mark.parametrize("plan", ["1f1b", "gpipe"])
def test_micro_batches_are_refused_at_the_microbatch_line(plan):
    with pytest.raises(SsdslError) as info:
        verify_before_launch(JobSpec(str(MODEL), plan), 2)
    err = info.value
    assert type(err).__name__ == "BufferUpdatedPerForward"
    line = Path(str(err.span.file)).read_text().splitlines()[err.span.line - 1]
    assert line.lstrip().startswith("microbatch along batch"), line
    assert "'calls'" in err.message and "4 micro-batches" in err.message
    assert err.origin is not None and err.origin.line == MODEL.read_text().splitlines().index(
        "        self.calls += 1") + 1


@pytest.mark.parametrize("plan,sets", [("dp", ()), ("1f1b", (("microbatches", "1"),))])
def test_without_micro_batches_it_is_verified(plan, sets):
    got = verify_before_launch(JobSpec(str(MODEL), plan, sets), 2)
    assert got.status == "verified", got.reason


@pytest.mark.slow  # two rank processes
def test_the_counter_counts_steps_as_on_one_device(tmp_path, capsys):
    import torch

    from ssdsl.cli import main
    saved = tmp_path / "state.pt"
    code = main(["run", str(MODEL), "1f1b", "--nproc", "2", "--set", "microbatches=1",
                 "--steps", "3", "--check", "--dtype", "float64", "--optimizer", "sgd",
                 "--save", str(saved), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out["check"]
    assert int(torch.load(saved)["calls"]) == 3


AVERAGE = Path(__file__).resolve().parent / "models" / "running_average.py"


def test_a_running_average_from_a_detached_tensor_is_verified():
    """The rewrite the refusal of a ``with torch.no_grad():`` block hints at
    (tests/models_bad/forward_no_grad_block.py) traces, and a data-parallel step computes the
    average over the whole batch, as on one device."""
    got = verify_before_launch(JobSpec(str(AVERAGE), "dp"), 2)
    assert got.status == "verified", got.reason


@pytest.mark.slow  # two rank processes
def test_the_running_average_trains_like_the_plain_model(capsys):
    from tests.checked_run import assert_gloo_run_matches
    assert_gloo_run_matches(capsys, AVERAGE, "dp", 2, steps=3)
