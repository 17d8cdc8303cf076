"""A tensor split into micro-batches and read by an operator for its dtype only, where its batch
dim is an ``ignored`` dim of that operator (``mask.type_as(embeds)``, ``embeds.new_ones(idx.shape)``
with ``embeds`` of another rank, as HF Funnel does): each micro-batch reads its own share there,
and ``new_ones`` makes its own rows (its batch is the output's dim, not the ignored input's).
Such models were refused by every micro-batched plan ("micro-batch 1 of operator ... is not
micro-batch 0's moved along 'batch'").

Oracle: the plain single-device model (verification's simulated step, and ``--check``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.cli import main

MODEL = Path(__file__).resolve().parent / "models" / "type_as_other_rank.py"


@pytest.mark.parametrize("plan", [["1f1b", "--set", "microbatches=4"],
                                  ["gpipe", "--set", "microbatches=2"]])
def test_micro_batches_of_a_dtype_read_verify(capsys, plan):
    code = main(["check", str(MODEL), plan[0], "--world", "2", *plan[1:], "--verify"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "verified:" in out.out


def test_new_ones_of_another_rank_names_its_own_batch():
    from ssdsl.trace.export import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.ops import annotate
    g = trace(load_model_file(str(MODEL)))
    op = next(o for o in g.ops if o.kind == "new_ones")
    ann = annotate(g, op)
    label = ann.label_for("batch")
    # the output's dim, not the ignored dim of the tensor read for its dtype
    assert label not in ann.ignored
    assert any(f.label == label for dim in ann.outputs[0] for f in dim)


@pytest.mark.slow
def test_one_f_one_b_of_a_dtype_read_trains_like_one_device(capsys):
    code = main(["run", str(MODEL), "1f1b", "--nproc", "2", "--set", "microbatches=4",
                 "--check", "--dtype", "float64", "--optimizer", "sgd", "--steps", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out["check"]
    worst = {m["what"]: m["error"] for m in out["check"]["worst"]}
    assert worst["loss"] < 1e-9 and worst["param"] < 1e-9
