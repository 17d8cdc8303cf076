"""``ssdsl check MODEL PLAN``: a plan resolved against a traced model, one row per operator.

The model is traced on the meta device (nothing is allocated), the plan's partition, replicate
and assign directives are applied (``ssdsl.transform``), and each operator is shown with its parts:
which dims were split into how many, how many copies, and the devices that hold them.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ssdsl.elaborate.directives import ElaboratedPlan
from ssdsl.trace import trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.trace.table import plan_word
from ssdsl.transform import Part, Transformed


def check_model(model: str, plan: ElaboratedPlan, *, as_json: bool = False,
                verify: bool = False, program: int | None = None) -> int:
    """Trace ``model``, apply ``plan``, derive its communication, print the result.

    With ``verify``, the model is also built for real and traced on the CPU, every adapter is
    run on random data, and one whole training step of all ranks (their lowered programs,
    pipelines and micro-batches included) is simulated in one process and compared with the
    plain model.
    Every rank's program is lowered and checked (``ssdsl.check.check_programs``); with
    ``program``, that rank's program is printed in its text form instead of the tables.
    Returns the exit status: 1 when verification finds a fault.
    """
    from ssdsl.materialize.program import materialize
    from ssdsl.materialize.report import comm_report

    mf = load_model_file(model)
    result, lowered = _resolve(trace(mf, device="meta"), plan)
    m = materialize(result, schedule=lowered)
    programs = lower_and_check(m)
    if program is not None:
        return _print_program(programs, program)
    table, comm = comm_report(m)
    verdict = _verify(mf, plan) if verify else None
    rows = op_rows(result)
    if as_json:
        from ssdsl.cli.jsonout import emit
        data = to_json(model, plan, result, rows)
        data["communication"] = comm
        data["programs"] = {"ranks": len(programs),
                            "instructions": [len(p) for p in programs]}
        if verdict is not None:
            data["verify"] = {"ok": verdict.ok, "problems": list(verdict.problems),
                              "edges_checked": verdict.edges_checked,
                              "loss": verdict.loss, "reference_loss": verdict.reference_loss,
                              "max_grad_error": verdict.max_grad_error}
            data["ok"] = verdict.ok
        emit("check", data)
    else:
        print_table(model, plan, result, rows)
        from rich.console import Console
        console = Console()
        console.print(table)
        for z in comm["zero"]:
            console.print(z["text"], highlight=False)
        if verdict is not None:
            _print_verdict(console, verdict)
    return 0 if verdict is None or verdict.ok else 1


def lower_and_check(m) -> tuple:
    """Every rank's lowered program, checked (phases 7 and 8)."""
    from ssdsl.check import check_programs
    from ssdsl.lower import lower_plan

    programs = lower_plan(m).programs
    check_programs(programs, m=m)
    return programs


def _print_program(programs, rank: int) -> int:
    from ssdsl.errors import UsageError
    from ssdsl.lower import program_text

    if not 0 <= rank < len(programs):
        raise UsageError(f"--program {rank}: the plan has ranks 0..{len(programs) - 1}")
    sys.stdout.write(program_text(programs[rank]))
    return 0


def _resolve(graph, plan: ElaboratedPlan):
    """Transform, then place stages, split micro-batches, resolve orders and recompute, and
    check the schedule: the same phases as ``ssdsl run`` (``ssdsl.runtime.job.schedule_plan``)."""
    from ssdsl.runtime.job import schedule_plan
    return schedule_plan(graph, plan)


def _verify(mf, plan: ElaboratedPlan):
    """Verify the plan on a graph traced on the CPU with the real, seeded model."""
    from ssdsl.materialize.program import materialize
    from ssdsl.runtime.verify import verify_plan

    model = mf.build(seed=0)
    result, lowered = _resolve(trace(mf, device="cpu", model=model), plan)
    m = materialize(result, schedule=lowered)
    return verify_plan(m, model_file=mf)


def _print_verdict(console, verdict) -> None:
    if verdict.ok:
        line = f"verified: {verdict.edges_checked} edges give every consumer exactly its region"
        if verdict.loss is not None:
            line += (f"; one simulated step: loss {verdict.loss:.6g} (model "
                     f"{verdict.reference_loss:.6g}), worst gradient error "
                     f"{verdict.max_grad_error:.2g}")
        console.print(line, style="green", highlight=False)
        return
    console.print(f"verification FAILED ({len(verdict.problems)} problems):", style="red")
    for problem in verdict.problems[:20]:
        console.print(f"  {problem}", highlight=False)


def op_rows(t: Transformed) -> list[dict[str, Any]]:
    """One dict per operator, in graph order: its parts and how they were made."""
    rows = []
    for op in t.graph.ops:
        parts = t.parts[op.name]
        ann = t.annotations[op.name]
        names = dict(getattr(ann, "names", {}))
        # the words a plan writes for a label (a linear's `out`, `in`), for the text table only:
        # the JSON keeps the labels its schema has always had
        words = {label: word for word, label in getattr(ann, "words", {}).items()}
        rows.append({
            "name": op.name, "kind": op.kind, "module": op.module,
            "parts": len(parts),
            "split": {_dim_name(label, names): n for label, n in _split_counts(parts).items()},
            "copies": _copies(parts),
            "partial_sums": any(p.sub.value for p in parts),
            "devices": sorted({p.device for p in parts if p.device is not None}),
            "part_list": [_part_json(p, names) for p in parts],
            "split_words": {_dim_name(label, names): plan_word(names.get(label)
                                                               or words.get(label) or label)
                            for label in _split_counts(parts)},
        })
    return rows


def _split_counts(parts: Sequence[Part]) -> dict[str, int]:
    """For each split label, into how many ranges the parts cut it."""
    ranges: dict[str, set] = {}
    for p in parts:
        for label, interval in p.ranges:
            ranges.setdefault(label, set()).add(interval)
    return {label: len(seen) for label, seen in ranges.items() if len(seen) > 1}


def _copies(parts: Sequence[Part]) -> int:
    """How many copies replicate made of each part (1: none)."""
    return max((len({p.replica_index for p in parts}), 1))


def _dim_name(label: str, names: dict[str, str]) -> str:
    """``batch`` for a label carrying a flowing name, else the op-local label (``n``)."""
    return names.get(label, label)


def _part_json(p: Part, names: dict[str, str]) -> dict[str, Any]:
    return {"index": list(p.index), "replica": list(p.replica), "device": p.device,
            "ranges": {_dim_name(label, names): list(r) for label, r in p.ranges},
            "partial_sum": bool(p.sub.value)}


def to_json(model: str, plan: ElaboratedPlan, t: Transformed,
            rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "plan": plan.name, "file": plan.file, "world": plan.world,
            "params": {k: v if isinstance(v, (int, float, bool, str)) else str(v)
                       for k, v in plan.params},
            "ops": [{**{k: v for k, v in r.items() if k not in ("part_list", "split_words")},
                     "parts": r["part_list"]} for r in rows],
            "devices": t.devices(), "notes": list(t.notes),
            "deferred": [str(d) for d in t.deferred]}


def devices_text(devices: Sequence[int]) -> str:
    """``0..4`` (half-open, as ranges are in plans: devices 0, 1, 2, 3) for a run of consecutive
    ids, else ``0,2,5``; ``-`` for none."""
    from ssdsl.schedule.picture import ranges_text
    return ranges_text(devices) if devices else "-"


def split_text(row: dict[str, Any]) -> str:
    words = row.get("split_words", {})
    dims = [f"{words.get(d, d)}/{n}" for d, n in row["split"].items()]
    if row["copies"] > 1:
        dims.append(f"x{row['copies']} copies")
    if row["partial_sums"]:
        dims.append("(partial sums)")
    return " ".join(dims) or "-"


def print_table(model: str, plan: ElaboratedPlan, t: Transformed,
                rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    params = ", ".join(f"{k}={v!r}" for k, v in plan.params) or "no parameters"
    table = Table(title=f"{plan.name} on {model}: world={plan.world}, {params}",
                  title_justify="left")
    for col in ("name", "kind", "module", "parts", "split dims", "devices"):
        table.add_column(col, overflow="fold", justify="right" if col == "parts" else "left")
    for r in rows:
        style = "dim" if r["parts"] == 1 else None
        table.add_row(r["name"], r["kind"], r["module"] or "-", str(r["parts"]), split_text(r),
                      devices_text(r["devices"]), style=style)
    console.print(table, highlight=False)
    n_parts = sum(r["parts"] for r in rows)
    shown = [devices_text(t.devices())] + [devices_text(r["devices"]) for r in rows]
    console.print(f"{len(rows)} operators, {n_parts} parts on devices {shown[0]}"
                  + (" (a..b: devices a to b-1, as in plans)" if any(".." in x for x in shown)
                     else ""), highlight=False)
    for note in t.notes:
        console.print(f"note: {note}", style="yellow", highlight=False)
    if t.deferred:
        kinds = Counter(d.kind for d in t.deferred)
        console.print("schedule directives: "
                      + ", ".join(f"{n} {kind}" for kind, n in kinds.items()), style="dim",
                      highlight=False)
