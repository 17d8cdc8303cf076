"""Verification before launch stops the kinds of wrong training that were once found silent
(issue 17), with the rule that now prevents each one undone, so the verification itself is what
is under test: should a rule regress, or a new rule of the same kind be wrong, the run must still
stop before any rank starts, naming a plan line.

Two of the kinds whose rules ssdsl has since fixed:

- a tensor-parallel linear whose bias is added by every part of a value split (the bias rule of
  ``ssdsl.ops.matmul`` undone: every part keeps the bias);
- a loss averaged over the labelled tokens under a batch split (the loss normalization of
  ``ssdsl.transform.normalize`` undone: each part's token mean is scaled by its share of the
  batch).

A tied weight split one way and used another (the third kind) is in tests/test_verify_catches.py
with a bias added by HF GPT-2's ``addmm`` parts; this file undoes the bias rule on a ``linear``.
Dropout and an unseeded ``get_batch`` (the other two kinds) are in tests/test_preflight.py. The
oracle is the plain single-device model, run by ``verify_before_launch`` through
``run_reference``, a path the programs do not share.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ssdsl.runtime.job import JobSpec
from ssdsl.runtime.preflight import TrainsDifferently, verify_before_launch
from ssdsl.source import source_text
from tests.test_loss_forms import model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")


def _stops_at_a_plan_line(spec: JobSpec, world: int) -> TrainsDifferently:
    with pytest.raises(TrainsDifferently) as info:
        verify_before_launch(spec, world)
    err = info.value
    assert err.span is not None and err.span.line >= 1, err.message
    return err


def _statement(err: TrainsDifferently) -> str:
    """The plan line the error points at."""
    return source_text(err.span.file).splitlines()[err.span.line - 1]


@pytest.mark.slow
def test_the_rules_hold_so_the_same_plans_verify(tmp_path):
    """Without the faults, the same plans verify: the stops below are the faults' doing."""
    assert verify_before_launch(JobSpec(GPT, "megatron_tp", (("tp", "2"),)), 2).verified
    assert verify_before_launch(JobSpec(model_file(tmp_path, "token_mean"), "dp"), 2).verified


@pytest.mark.slow
def test_a_bias_added_by_every_part_is_stopped(monkeypatch):
    import ssdsl.ops.matmul as matmul
    monkeypatch.setattr(matmul, "first_value_part", lambda ann, ranges: True)
    err = _stops_at_a_plan_line(JobSpec(GPT, "megatron_tp", (("tp", "2"),)), 2)
    # blamed on the row-parallel c_proj, whose partial sums no longer add up to its output
    assert "'h.0.attn.c_proj'" in err.message, err.message
    assert "{attn_out} along in" in _statement(err)


def test_a_token_mean_scaled_by_share_of_the_batch_is_stopped(monkeypatch, tmp_path):
    """The old rule: the normalization left out, and the token mean split like an example mean
    (each part's mean scaled by its share of the batch)."""
    import attrs

    import ssdsl.ops.core as core
    import ssdsl.transform.apply as apply
    target = "aten.cross_entropy_loss.default"
    rule = core.registered()[target]

    def share_scaled(call):
        ann = rule(call)
        return attrs.evolve(ann, frozen={k: v for k, v in ann.frozen.items() if k == "C"})

    monkeypatch.setitem(core._RULES, target, share_scaled)
    monkeypatch.setattr(apply, "normalize_losses", lambda graph: graph)
    err = _stops_at_a_plan_line(JobSpec(model_file(tmp_path, "token_mean"), "dp"), 2)
    assert "operator 'cross_entropy_loss'" in err.message, err.message
    assert "along batch" in _statement(err)
