"""Micro-batch 0 with the others in closed form (``_by_shift``) against the general path, which
derives every micro-batch and compares them: the same transformed plan where the closed form
proves micro-batches alike, and the general path's answer where it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

import ssdsl.transform.microbatch as mb
from ssdsl.elaborate import elaborate_file
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def graph():
    return trace(load_model_file(str(GPT)), device="meta")


def _both(graph, plan: str, world: int, sets: dict[str, str], monkeypatch):
    """(closed form taken, its result or error), (the general path's result or error)."""
    taken = []
    closed = mb._by_shift

    def spy(t, d):
        got = closed(t, d)
        taken.append(got is not None)
        return got

    def run():
        try:
            t, lowered = schedule_plan(graph, elaborate_file(plan, world=world, sets=sets))
            return t.parts, t.shapes, t.input_boxes, t.boxes, t.microbatches
        except mb.TransformError as err:
            return type(err), err.message, err.span
    monkeypatch.setattr(mb, "_by_shift", spy)
    fast = run()
    monkeypatch.setattr(mb, "_by_shift", lambda t, d: None)
    return taken, fast, run()


@pytest.mark.parametrize("plan, world, sets", [
    ("dp_tp_1f1b", 8, {"dp": "2", "tp": "2", "pp": "2", "microbatches": "4"}),
    ("1f1b", 2, {"microbatches": "8"}),
    ("interleaved_1f1b", 2, {}),
    ("zb_v", 2, {}),
])
def test_alike_micro_batches_take_the_closed_form(graph, plan, world, sets, monkeypatch):
    taken, fast, general = _both(graph, plan, world, sets, monkeypatch)
    assert taken == [True]
    assert fast == general


def _plan(tmp_path: Path, body: str) -> str:
    path = tmp_path / "p.ssp"
    path.write_text("plan p()\n" + body)
    return str(path)


def test_parts_with_different_shares_take_the_general_path(graph, tmp_path, monkeypatch):
    """One block split along the batch, the rest whole: a tensor between them moves by a quarter
    of the batch per micro-batch on one side and by half on the other."""
    plan = _plan(tmp_path, "microbatch along batch into 2\npartition h.0 along batch into 2\n"
                 "assign all to device 0\n")
    taken, fast, general = _both(graph, plan, 1, {}, monkeypatch)
    assert taken == [False]
    assert fast == general
    assert fast[0] is mb.UnevenMicrobatches  # micro-batch 1 reads the tensor elsewhere


def test_a_lowering_that_reads_starts_is_lowered_per_micro_batch(graph, monkeypatch):
    """An unmarked lowering (``by_extent``) is lowered for every micro-batch and compared."""
    from ssdsl.ops import core

    def plain(call, ann, ranges, args, kwargs):  # the default lowering, without its mark
        return core.LocalCall(call.op.target, args, tuple(kwargs.items()))
    seen = []
    real = core.reads_extents_only
    monkeypatch.setattr(mb, "reads_extents_only", lambda fn: seen.append(fn) or False)
    taken, fast, general = _both(graph, "1f1b", 2, {"microbatches": "4"}, monkeypatch)
    assert taken == [True] and seen and fast == general
    assert real(core.keep_args) and not real(plain)
