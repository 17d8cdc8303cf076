"""Plans written by hand as a user would, probing rules the checker must enforce; each test
names the defect it found. Oracles: the traced graph as `ssdsl trace` shows it, and the
single-device model (``--check`` runs)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from ssdsl.elaborate import elaborate_text
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform.normalize import normalize_losses
from tests.checked_run import assert_gloo_run_matches

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
MLP = ROOT / "examples" / "mlp.py"
HAND = Path(__file__).parent / "plans" / "hand"


@cache
def _graph(model: Path):
    return trace(load_model_file(model), device="meta")


# --- kind names: the kind `ssdsl trace` prints selects the operator -----------------------------

def test_every_kind_after_loss_normalization_is_a_trace_kind():
    """The loss's rewrite (per-token terms / count, summed) made its terms op with the raw ATen
    name (`cross_entropy_loss`) while `ssdsl trace` prints `cross_entropy`, so
    `kind(cross_entropy)` matched nothing. Every op the rewrite keeps from the traced graph must
    keep the kind the trace printed for that ATen target."""
    g = _graph(GPT)
    printed = {op.target: op.kind for op in g.ops}
    for op in normalize_losses(g).ops:
        if op.target in printed:
            assert op.kind == printed[op.target], (op.name, op.kind, printed[op.target])


def test_loss_selected_by_its_printed_kind():
    plan = elaborate_text("plan p()\npartition kind(cross_entropy) along batch into 2\n"
                          "replicate rest into 2\nassign each part i to device i\n",
                          "loss_kind.ssp", world=2)
    schedule_plan(_graph(GPT), plan)  # raised EmptySelection before


@pytest.mark.slow
def test_loss_partitioned_by_kind_matches(capsys):
    assert_gloo_run_matches(capsys, GPT, str(HAND / "loss_kind_batch.ssp"), 2)
