"""Plan statements that used to be accepted and then dropped or failing inside every rank
(issue 9): ``order`` in a plan without stages, and ``recompute`` of a stage or of nothing.

Each is either refused at its statement by the phases ``ssdsl check`` runs (before any rank
starts), or lowered into what runs; a run is compared with the plain model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssdsl.cli import main
from ssdsl.elaborate import elaborate
from ssdsl.errors import SsdslError
from ssdsl.parse import parse_text
from ssdsl.runtime.job import schedule_plan
from ssdsl.trace.export import trace
from ssdsl.trace.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
DP = "partition all along batch into 2\nassign each part i to device i\n"
PIPE = ("microbatch along batch into 2\nstages into 2 as st\nassign st[0] to device 0\n"
        "assign st[1] to device 1\n")


@pytest.fixture(scope="module")
def graph():
    return trace(load_model_file(GPT), device="meta")


def _schedule(graph, body: str):
    plan = elaborate(parse_text(f"plan p()\n{body}", "p.ssp"), world=2)
    return schedule_plan(graph, plan)


def _refused(graph, body: str) -> SsdslError:
    with pytest.raises(SsdslError) as info:
        _schedule(graph, body)
    return info.value


@pytest.mark.parametrize("body, cls, line, words", [
    (DP + "order h.1.attn before h.0.mlp\n", "OrderConflict", 4, "contradicts the data"),
    (DP + "order h.0 before h.0.mlp\n", "OrderConflict", 4, "on both sides"),
    (DP + "order wpe before wte\norder wte before wpe\n", "OrderConflict", 4, "cycle"),
    (DP + "order forward all mb 0 before backward all mb 0\n", "UnsupportedOrderUnit", 4,
     "no 'stages'"),
    (DP + "recompute h.7\n", "EmptySelection", 4, "matches no operator"),
    (PIPE + "recompute h.7\n", "EmptySelection", 6, "matches no operator"),
], ids=["against-data", "overlap", "cycle-of-two", "pass-without-stages", "recompute-nothing",
        "recompute-nothing-pipeline"])
def test_refused_at_the_statement(graph, body, cls, line, words):
    err = _refused(graph, body)
    assert type(err).__name__ == cls
    assert err.span is not None and err.span.line == line, err.span
    assert words in err.message


def test_order_consistent_with_data_becomes_the_operator_order(graph):
    t, _ = _schedule(graph, DP + "order wpe before wte\n")
    names = [op.module for op in t.graph.ops]
    assert names.index("wpe") < names.index("wte")
    untouched, _ = _schedule(graph, DP)
    before = [op.module for op in untouched.graph.ops]
    assert before.index("wte") < before.index("wpe")  # the statement changed the traced order
    # the new order is still topological: every input is made before it is read
    made = set(t.graph.inputs) | set(t.graph.params) | set(t.graph.buffers) | set(t.graph.constants)
    for op in t.graph.ops:
        assert all(x in made for x in op.inputs), op.name
        made.update(op.outputs)


def test_recompute_of_a_stage_is_its_operators(graph):
    t, _ = _schedule(graph, PIPE + "recompute st[0]\n")
    assert t.recompute and set(t.recompute) == {op.name for op in t.graph.ops if t.stage(op.name) == 0}


def test_check_cli_refuses_recompute_of_nothing(tmp_path, capsys):
    plan = tmp_path / "p.ssp"
    plan.write_text(f"plan p()\n{DP}recompute h.7\n")
    assert main(["check", GPT, str(plan), "--world", "2"]) == 2
    assert "p.ssp:4:1" in capsys.readouterr().err


def _run(capsys, tmp_path, body: str) -> dict:
    plan = tmp_path / "p.ssp"
    plan.write_text(f"plan p()\n{body}")
    code = main(["run", GPT, str(plan), "--nproc", "2", "--steps", "2", "--dtype", "float64",
                 "--optimizer", "sgd", "--check", "--json", "--timeout", "200"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["check"]["ok"], out["check"]
    return out


@pytest.mark.slow
def test_ordered_plan_runs_like_the_plain_model(capsys, tmp_path):
    _run(capsys, tmp_path, DP + "order wpe before wte\n")


@pytest.mark.slow
def test_recompute_of_a_stage_runs_like_the_plain_model(capsys, tmp_path):
    _run(capsys, tmp_path, PIPE + "recompute st[0]\n")
