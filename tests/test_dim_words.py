"""Plain words for a linear's dims (`out`, `in`) name the same split as the raw labels, and
`ssdsl trace` shows them."""

from __future__ import annotations

from pathlib import Path

from ssdsl.elaborate import elaborate_text
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.trace.table import op_rows
from ssdsl.transform import transform

MLP = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")
PLAN = """plan p()
partition layers.1 along {dim} into 2
replicate rest into 2
assign each part i to device i
"""


def parts(graph, dim: str):
    t = transform(graph, elaborate_text(PLAN.format(dim=dim), "p.ssp", world=2))
    return [(p.index, p.sub.inputs, p.sub.outputs, p.sub.value) for p in t.parts["linear_1"]]


def test_out_and_in_are_the_linear_labels():
    graph = trace(load_model_file(MLP))
    assert parts(graph, "out") == parts(graph, "n")
    assert parts(graph, "in") == parts(graph, "k")
    assert parts(graph, "out") != parts(graph, "in")
    # the row-parallel split makes partial sums, the column-parallel one does not
    assert all(v for *_, v in parts(graph, "in")) and not any(v for *_, v in parts(graph, "out"))


def test_trace_names_the_words():
    rows = {r["name"]: r for r in op_rows(trace(load_model_file(MLP)))}
    names = {d["label"]: d["name"] for d in rows["linear_1"]["dims"]}
    assert names["n"] == "out" and names["k"] == "in"
