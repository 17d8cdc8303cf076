"""The plan's communication per training step, as a table and as data (no execution)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ssdsl.materialize.program import Edge, Materialized
from ssdsl.materialize.steps import Adapter, PointToPoint

EdgeKey = tuple[str, str, int]


def uses_fallback(adapter: Adapter) -> bool:
    """Whether the adapter (forward or backward) moves data point to point."""
    steps = [*adapter.steps, *(adapter.backward.steps if adapter.backward else ())]
    return any(isinstance(s, PointToPoint) and s.count for s in steps)




def comm_report(m: Materialized, *, title: str = "communication per step"
                ) -> tuple[Table, dict[str, Any]]:
    """The plan's communication per training step as a rich table and as plain data.

    The data is ``Materialized.accounting()`` (``forward`` / ``backward`` / ``gradients``:
    ``{kind: {"count", "bytes"}}`` and ``total_bytes``) plus ``edges``: one entry per edge that
    moves anything, with its kinds, bytes, and whether it uses the point-to-point fallback.
    Bytes are totals received over all devices (``ssdsl.materialize.steps``).
    """
    acc = m.accounting()
    edges = [_edge_entry(k, e) for k, e in m.edges.items()
             if e.adapter.steps or (e.adapter.backward is not None and e.adapter.backward.steps)]
    data = {**acc, "edges": edges,
            "fallback_edges": sum(1 for e in edges if e["fallback"]), "zero": zero_summary(m)}
    table = Table(title=title)
    for col, justify in (("pass", "left"), ("primitive", "left"), ("calls", "right"),
                         ("bytes", "right")):
        table.add_column(col, justify=justify)
    for section in ("forward", "backward", "gradients"):
        for kind, v in sorted(acc[section].items()):
            table.add_row(section, kind, str(v["count"]), _human(v["bytes"]))
    table.add_row("total", "", "", _human(acc["total_bytes"]), style="bold")
    if data["fallback_edges"]:
        table.caption = f"{data['fallback_edges']} edge(s) use the point-to-point fallback"
    return table, data


_KEEPS = {1: "the optimizer state of its chunk", 2: "the gradient and optimizer state of its chunk",
          3: "the weights, gradient and optimizer state of its chunk; weights gathered per use"}


def zero_summary(m: Materialized) -> list[dict[str, Any]]:
    """One entry per ``zero`` statement: its line, stage, buckets, elements and group sizes."""
    by: dict[Any, list] = {}
    for b in m.reducer.buckets:
        if b.zero:
            by.setdefault((b.span, b.zero), []).append(b)
    out = []
    for (span, stage), buckets in by.items():
        numel = sum(b.size // b.itemsize for b in buckets)
        sizes = sorted({len(b.devices) for b in buckets})
        where = f"{span.file.rsplit('/', 1)[-1]}:{span.line}:{span.column}" if span else "zero"
        text = (f"ZeRO stage {stage} ({where}): {len(buckets)} bucket(s), {numel:,} elements "
                f"over groups of {'/'.join(map(str, sizes))}; each member keeps {_KEEPS[stage]}")
        out.append({"line": where, "stage": stage, "buckets": len(buckets), "elements": numel,
                    "group_sizes": sizes, "text": text})
    return out


def _edge_entry(key: EdgeKey, e: Edge) -> dict[str, Any]:
    back = e.adapter.backward
    return {"tensor": key[0], "op": key[1], "slot": key[2],
            "forward": list(e.adapter.kinds), "forward_bytes": e.adapter.nbytes,
            "backward": list(back.kinds) if back is not None else [],
            "backward_bytes": back.nbytes if back is not None else 0,
            "fallback": uses_fallback(e.adapter)}


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
