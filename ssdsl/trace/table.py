"""The operator table that ``ssdsl trace`` prints: one row per op, with its splittable dims."""

from __future__ import annotations

from typing import Any

from ssdsl.ir.graph import Graph, Op
from ssdsl.ops import Annotation, NotAnnotated, annotate


def op_rows(graph: Graph) -> list[dict[str, Any]]:
    """One JSON-ready record per op: identity, output shapes, and each label with its mark."""
    return [_row(graph, op) for op in graph.ops]


def _row(graph: Graph, op: Op) -> dict[str, Any]:
    ann = annotate(graph, op)
    outs = [graph.tensors[t] for t in op.outputs]
    row: dict[str, Any] = {
        "name": op.name, "kind": op.kind, "target": op.target, "module": op.module,
        "inputs": list(op.inputs),
        "outputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                     "dims": list(t.dim_names)} for t in outs],
        "annotated": not isinstance(ann, NotAnnotated),
    }
    if isinstance(ann, NotAnnotated):
        row["replicate_only"] = ann.reason
        row["dims"] = []
    else:
        row["dims"] = _dims(ann)
    return row


def _dims(ann: Annotation) -> list[dict[str, Any]]:
    words = {label: word for word, label in ann.words.items()}
    return [{"label": lab.name, "name": ann.names.get(lab.name) or words.get(lab.name),
             "size": lab.size,
             "mark": lab.mark, **({"reason": lab.reason} if lab.reason else {})}
            for lab in ann.labels().values()]


def splittable_text(row: dict[str, Any]) -> str:
    """``batch:8 seq:16 n:96 k:32(sum)`` for the table; the reason for a replicate-only op."""
    if not row["annotated"]:
        return f"replicate only: {row['replicate_only']}"
    parts = []
    for d in row["dims"]:
        if d["mark"] in ("frozen", "ignored"):
            continue
        text = f"{plan_word(d['name'] or d['label'])}:{d['size']}"
        parts.append(text + ("(sum)" if d["mark"] == "reduced" else ""))
    return " ".join(parts) or "-"


def plan_word(label: str) -> str:
    """How a plan writes a dim: a factor ``n.1`` or ``height.1`` as ``n_1``, ``height_1`` (the
    grammar's names have no dots; ``partition`` reads both back to the same label)."""
    return label.replace(".", "_")


def shape_text(row: dict[str, Any]) -> str:
    return ", ".join("x".join(map(str, o["shape"])) or "scalar" for o in row["outputs"])
