"""A rank's last backward sends its gradients before computing the weights' (``Backward.part``).

In a pipeline's cool-down each stage's last backward is what the stage before waits for, and
nothing waits on the stage itself afterwards. The lowering walks that backward in two: the
first walk computes only the gradients the unit sends on, the send goes out, and the second walk
computes the weights' gradients. Oracles: the plain single-device model (loss and every
gradient of step 0 in float64, every rank's lowered program simulated in one process, which
runs the very handlers the ranks run), and the plans' own shape (which rank sends what to whom,
read from the programs' communication, not from the rule under test).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ssdsl.lower.build as build
from ssdsl.lower.text import parse_program, program_text
from ssdsl.runtime.simulate import simulate_model_file
from ssdsl.runtime.verify import compare_with_model

from tests.test_boundary_reads import RECOMPUTED  # 1F1B on 2 devices, stage 1 recomputed
from tests.test_own_loss import _plan



def _lower(tmp: Path, plan: str, world: int, **sets):
    """Every rank's checked program of ``plan`` (a stdlib name or a plan's text) on the GPT."""
    if "\n" in plan:
        (tmp / "p.ssp").write_text(plan)
        plan = str(tmp / "p.ssp")
    return _plan(plan, world, **sets)


def _parts(p) -> list[tuple[int, str]]:
    return [(i, x.part) for i, x in enumerate(p.instructions)
            if x.kind == "backward" and x.part != "whole"]


def _last_backward_sends(p) -> bool:
    """Whether the rank's last backward unit sends another rank a gradient (a backward comm
    with a send)."""
    units = [i for i, x in enumerate(p.instructions) if x.kind == "begin" and "B" in x.unit]
    return any(x.kind == "comm" and x.backward and any(
        getattr(s, "msgs", None) and any(m.kind == "send" for m in s.msgs) for s in x.steps)
        for x in p.instructions[units[-1]:])


PIPELINES = [("1f1b", 2, {}), ("1f1b", 4, {}), ("gpipe", 2, {}), ("interleaved_1f1b", 2, {}),
             ("dp_tp_1f1b", 8, {"dp": 2, "tp": 2, "microbatches": 2})]


@pytest.mark.parametrize("plan, world, sets", PIPELINES,
                         ids=[f"{p}-{w}" for p, w, _ in PIPELINES])
def test_the_last_backward_sends_before_the_weights_and_trains_like_the_model(
        tmp_path, plan, world, sets):
    mf, m, programs = _lower(tmp_path, plan, world, **sets)
    for p in programs:
        parts = _parts(p)
        if not _last_backward_sends(p):  # the first stage: nobody waits for its gradients
            assert parts == []
            continue
        (i, first), (j, second) = parts
        assert (first, second) == ("sent", "rest")
        a, b = p.instructions[i], p.instructions[j]
        assert (a.seeds, a.roots, a.collect) == (b.seeds, b.roots, b.collect)
        between = p.instructions[i + 1:j]
        assert between and all(x.kind == "comm" and x.backward for x in between)
        # in the rank's last backward unit: no backward of any unit runs after the second walk
        assert not any(x.kind.startswith("backward") for x in p.instructions[j + 1:])
        assert parse_program(program_text(p)) == p
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


def test_without_the_rule_every_backward_is_one_walk(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "SEND_FIRST", False)
    mf, m, programs = _lower(tmp_path, "1f1b", 2)
    assert all(_parts(p) == [] for p in programs)
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


def test_a_recomputed_stage_is_walked_once(tmp_path):
    """A second walk would run the recomputed calls again: the stage keeps one walk."""
    mf, m, programs = _lower(tmp_path, RECOMPUTED, 2)
    assert any(x.kind == "recompute" for x in programs[1].instructions)
    assert all(_parts(p) == [] for p in programs)
    problems, _, _ = compare_with_model(m, mf, simulate_model_file(m, programs, mf))
    assert not problems, problems


@pytest.mark.parametrize("plan, world, sets", [("megatron_tp", 2, {}), ("dp", 2, {}),
                                               ("zb_h1", 2, {})])
def test_plans_that_send_no_stage_gradients_or_split_already_are_unchanged(
        tmp_path, plan, world, sets):
    """Tensor and data parallelism send no gradient to a waiting stage; a zero-bubble plan's
    backwards are split by the plan itself."""
    _, _, programs = _lower(tmp_path, plan, world, **sets)
    assert all(_parts(p) == [] for p in programs)
