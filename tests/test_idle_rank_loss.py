"""A device the plan leaves empty still takes part in the step's loss sum, by the same
all-reduce as its peers.

A rank that runs no unit (a 2-stage pipeline on 3 ranks: rank 2 holds nothing) has a loss share
known from the start (zero); the early loss sum (``ssdsl.runtime.early_loss``) started it at the
first ``begin``, which such a rank never reaches, so it issued the in-place all-reduce while its
peers issued the early, asynchronous one. Over a group that is not a power of two the two run
different algorithms (``exchange.all_reduce``: gloo's, and the exchange fold), and the ranks hung
in the loss sum after verification had passed. The oracle is the single-device model
(``--check`` in float64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.cli import main

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")


@pytest.mark.slow
@pytest.mark.parametrize("plan, sets", [("1f1b", ["stages=2"])])
def test_a_pipeline_that_leaves_a_rank_empty_trains_like_the_plain_model(capsys, plan, sets):
    argv = ["run", MLP, plan, "--nproc", "3", "--steps", "2", "--check", "--json",
            "--dtype", "float64", "--optimizer", "sgd", "--timeout", "120"]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    out = json.loads(capsys.readouterr().out)
    assert out["check"]["ok"], out["check"]
    assert code == 0
    worst = {w["what"]: w["error"] for w in out["check"]["worst"]}
    assert worst["loss"] < 1e-9 and worst["param"] < 1e-9, worst
