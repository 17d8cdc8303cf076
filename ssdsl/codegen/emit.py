"""The per-rank program as Python source, written from a ``Materialized`` plan.

For one rank, ``forward(rt, batch)`` lists in graph order exactly what the interpreter
(``ssdsl.runtime.executor.RankProgram.forward``) does for that rank: take a region of a batch
tensor (``rt.take``) or a parameter shard (``rt.param``), join an adapter (``rt.adapter(id, x)``,
``id`` being the edge's position in ``Materialized.edges``), and run the local ATen call of this
rank's part of an operator. Adapters with no step in either direction are plain pass-throughs and
are not written. Each statement ends with a comment naming the plan lines that caused it (the
partition/replicate that shaped the part and the assign that placed it); the module's head lists
those lines with their text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

import ssdsl
from ssdsl.codegen.text import Namer, literal, region_text
from ssdsl.errors import SsdslError
from ssdsl.ir.graph import Op
from ssdsl.materialize.program import Edge, Materialized, SourceUse
from ssdsl.materialize.steps import Adapter, PointToPoint
from ssdsl.source import Span, source_text
from ssdsl.transform.parts import Part

# The first line of every generated file starts with this; ``write`` refuses to replace a file
# that does not, so a compile never clobbers a hand-written module.
GENERATED_MARK = "# ssdsl-generated: do not edit"


@attrs.frozen
class Provenance:
    """What the header names: model and plan files (base names only: output is deterministic)."""

    model: str
    plan: str
    plan_file: str
    params: tuple[tuple[str, Any], ...]
    world: int
    version: str = ssdsl.__version__

    @classmethod
    def of(cls, model: str | Path, plan: Any) -> Provenance:
        """From a model path and an ``ElaboratedPlan``."""
        return cls(Path(model).name, plan.name, Path(plan.file).name, tuple(plan.params),
                   plan.world)


@attrs.frozen
class Stmt:
    """One line of ``forward``: the code, a short note, and the plan positions that caused it."""

    code: str
    note: str = ""
    cites: tuple[Span, ...] = ()


def cite(span: Span) -> str:
    """``megatron_tp.ssp:20:1``: a plan position without the directory (deterministic)."""
    return f"{Path(span.file).name}:{span.line}:{span.column}"


class _RankEmitter:
    """Walks the graph as the interpreter does for one rank and records the statements."""

    def __init__(self, m: Materialized, rank: int, placed: Mapping[tuple[str, int], Part],
                 producer: Mapping[str, Op]) -> None:
        self.m, self.rank, self.placed, self.producer = m, rank, placed, producer
        self.graph = m.transformed.graph
        self.names = Namer()
        self.env: dict[str, str] = {}          # graph tensor -> variable holding this rank's part
        self.taken: dict[tuple, str] = {}      # (tensor, region, scale) -> variable
        self.shards: list[tuple[str, str, str]] = []
        self.stmts: list[Stmt] = []
        self.edge_ids = {key: i for i, key in enumerate(m.edges)}

    def run(self) -> None:
        for op in self.graph.ops:
            part = self.placed.get((op.name, self.rank))
            local = [self._input(op, slot, name, part) for slot, name in enumerate(op.inputs)]
            if part is not None:
                self._call(op, part, local)

    # -- inputs --------------------------------------------------------------------------------
    def _input(self, op: Op, slot: int, name: str, part: Part | None) -> str | None:
        reads = part is not None and part.sub.inputs[slot] is not None
        edge = self.m.edges.get((name, op.name, slot))
        if edge is not None:
            return self._adapter(edge, reads) if self.rank in edge.adapter.devices else None
        if reads:
            return self._source(self.m.sources[(name, op.name, slot, self.rank)], part)
        return None

    def _source(self, use: SourceUse, part: Part) -> str:
        key = (use.tensor, use.region, use.scale)
        if key in self.taken:
            return self.taken[key]
        var = self.names.fresh(use.tensor)
        self.taken[key] = var
        region = region_text(use.region)
        g = self.graph
        if use.tensor in g.inputs:
            i = g.inputs.index(use.tensor)
            code = (f"{var} = batch[{i}]" if use.region.is_full()
                    else f"{var} = rt.take(batch[{i}], {region!r})")
            self.stmts.append(Stmt(code, f"input {i}", _spans(part.span)))
            return var
        kind = "param" if use.tensor in g.params else "buffer"
        scale = f", scale={use.scale!r}" if use.scale != 1.0 else ""
        code = f"{var} = rt.{kind}({use.tensor!r}, {region!r}{scale})"
        qual = {**g.params, **g.buffers}.get(use.tensor, "constant")
        if kind == "param" and (use.tensor, region) not in [(s[0], s[2]) for s in self.shards]:
            self.shards.append((use.tensor, qual, region))
        self.stmts.append(Stmt(code, qual, _spans(part.span)))
        return var

    def _adapter(self, edge: Edge, reads: bool) -> str | None:
        ad, held = edge.adapter, self.env.get(edge.tensor)
        if reads and held is not None and _passthrough(ad):
            return held
        eid = self.edge_ids[(edge.tensor, edge.op, edge.slot)]
        call = f"rt.adapter({eid}, {held or 'None'})"
        note = f"{edge.tensor} -> {edge.op}[{edge.slot}]: {describe(ad, self.rank)}"
        cites = _spans(self._span_of(self.producer[edge.tensor].name),
                       self._span_of(edge.op))
        if not reads:
            self.stmts.append(Stmt(call, note + " (this rank only sends)", cites))
            return None
        var = self.names.fresh(f"{edge.tensor}_to_{edge.op}")
        self.stmts.append(Stmt(f"{var} = {call}", note, cites))
        return var

    def _span_of(self, op: str) -> Span | None:
        part = self.placed.get((op, self.rank)) or self.m.transformed.parts[op][0]
        return part.span

    # -- the local call ------------------------------------------------------------------------
    def _call(self, op: Op, part: Part, local: Sequence[str | None]) -> None:
        lc = part.sub.local
        arg = lambda v: literal(v, lambda i: local[i] or "None")  # noqa: E731
        args = [arg(v) for v in lc.args] + [f"{k}={arg(v)}" for k, v in lc.kwargs]
        ns, _, rest = lc.target.partition(".")
        fn = f"aten.{rest}" if ns == "aten" else f"torch.ops.{lc.target}"
        call = f"{fn}({', '.join(args)})"
        outs = [self.names.fresh(o) for o in op.outputs]
        self.env.update(zip(op.outputs, outs))
        if op.returns == "list":
            lhs = ", ".join(outs) + ("," if len(outs) == 1 else "")
            rhs = call if lc.scale == 1.0 else f"(o * {lc.scale!r} for o in {call})"
        else:
            lhs = outs[0]
            rhs = call if lc.scale == 1.0 else f"{call} * {lc.scale!r}"
        where = f"{op.module or '(top)'} part {_index(part)}"
        self.stmts.append(Stmt(f"{lhs} = {rhs}", where, _spans(part.span, part.assigned_at)))

    def loss(self) -> str:
        return self.env.get(self.graph.output, "None")


def _index(part: Part) -> str:
    if not part.index:
        return "whole"
    return "(" + ", ".join(f"{'r' if r else ''}{i}" for i, r in zip(part.index, part.replica)) + ")"


def _spans(*spans: Span | None) -> tuple[Span, ...]:
    out: list[Span] = []
    for s in spans:
        if s is not None and s not in out:
            out.append(s)
    return tuple(out)


def _passthrough(ad: Adapter) -> bool:
    """No step forward or backward: the consumer's tensor is the producer's (identity)."""
    return not ad.steps and (ad.backward is None or not ad.backward.steps)


def describe(ad: Adapter, rank: int) -> str:
    """``all_reduce over (0, 1); backward: identity``: what ``rank`` does in ``ad`` and its dual."""
    back = "none" if ad.backward is None else _steps_text(ad.backward, rank)
    return f"{_steps_text(ad, rank)}; backward: {back}"


def _steps_text(ad: Adapter, rank: int) -> str:
    parts = [_step_text(s, rank) for s in ad.steps]
    return ", then ".join(p for p in parts if p) or "identity"


def _step_text(step: Any, rank: int) -> str:
    if isinstance(step, PointToPoint):
        sends = sum(1 for x in step.messages if x.src == rank and x.dst != rank)
        recvs = sum(1 for x in step.messages if x.dst == rank and x.src != rank)
        return f"p2p (sends {sends}, receives {recvs})"
    group = next((g for g in step.groups if rank in g), None)
    if group is None:
        return ""
    extra = "".join(f" {f.name}={getattr(step, f.name)}" for f in attrs.fields(type(step))
                    if f.name not in ("groups", "nbytes"))
    return f"{step.kind}{extra} over {group}"


# -- the module ------------------------------------------------------------------------------


class NotGeneratable(SsdslError):
    """The plan needs something code generation does not write yet (stages, micro-batches...)."""


def check_generatable(m: Materialized) -> None:
    """Refuse plans whose per-rank program is more than one forward: pipelines, micro-batches,
    recompute and order run unit by unit (``RankProgram.run_unit``), which is not written yet."""
    t = m.transformed
    later = [d for d in t.deferred if getattr(d, "span", None) is not None]
    if getattr(m, "schedule", None) is None and getattr(t, "microbatches", 1) == 1 and not later:
        return
    span = later[0].span if later else None
    raise NotGeneratable(
        "ssdsl compile writes plans of one stage and one micro-batch only; this plan also "
        "has stages, micro-batches, recompute or order statements", span,
        hint="run it with `ssdsl run`, which interprets every plan")


def generate_rank(m: Materialized, rank: int, prov: Provenance) -> str:
    """The Python module of ``rank``: header, shard table, cited plan lines, ``forward``."""
    return _Generator(m, prov).rank(rank)


def generate_all(m: Materialized, prov: Provenance) -> dict[str, str]:
    """``{"rank0.py": text, ...}`` for every rank of the world."""
    gen = _Generator(m, prov)
    return {f"rank{r}.py": gen.rank(r) for r in range(prov.world)}


class _Generator:
    """What every rank's module needs, indexed once (parts by device, producers of tensors), so
    that writing all ranks costs the number of parts, not ranks times parts."""

    def __init__(self, m: Materialized, prov: Provenance) -> None:
        check_generatable(m)
        self.m, self.prov = m, prov
        self.placed = {(op, p.device): p for op, parts in m.transformed.parts.items()
                       for p in parts if p.device is not None}
        self.producer = m.transformed.graph.producer()

    def rank(self, rank: int) -> str:
        e = _RankEmitter(self.m, rank, self.placed, self.producer)
        e.run()
        body = _body(e)
        return _header(rank, self.prov, body) + body


def body_digest(text: str) -> str:
    """The digest a module carries of everything below its header (what the plan decided)."""
    body = text.split(_BODY_START, 1)[-1]
    return hashlib.sha256(body.encode()).hexdigest()[:16]


_BODY_START = "\n# -- shards "


def _header(rank: int, prov: Provenance, body: str) -> str:
    params = ", ".join(f"{k}={v!r}" for k, v in prov.params) or "no parameters"
    return (
        f"{GENERATED_MARK}; regenerate with `ssdsl compile`.\n"
        f'"""Rank {rank} of {prov.world}: plan {prov.plan} ({prov.plan_file}; {params}) '
        f"on model {prov.model}.\n\n"
        "Generated by ssdsl from the materialized plan. ``forward(rt, batch)`` is this rank's part\n"
        "of the training forward, in graph order; ``rt`` is ``ssdsl.codegen.runtime.Runtime``.\n"
        '"""\n\n'
        "import torch\n\n"
        "aten = torch.ops.aten\n\n"
        f"RANK = {rank}\nWORLD = {prov.world}\n"
        f"PLAN = {prov.plan!r}\nPLAN_FILE = {prov.plan_file!r}\n"
        f"PLAN_PARAMS = {dict(prov.params)!r}\n"
        f"MODEL_FILE = {prov.model!r}\nSSDSL_VERSION = {prov.version!r}\n"
        f"DIGEST = {body_digest(body)!r}\n")


def _body(e: _RankEmitter) -> str:
    lines = [_BODY_START.lstrip("\n") + "-" * 80, "# Parameter shards this rank holds: "
             "(graph tensor, qualified name, region).", "SHARDS = ("]
    lines += [f"    {s!r}," for s in e.shards]
    lines += [")", ""]
    lines += _legend(e.stmts)
    lines += ["", "", "def forward(rt, batch):"]
    lines += ["    " + _line(s) for s in e.stmts]
    lines += [f"    return {e.loss()}", ""]
    return "\n" + "\n".join(lines)


def _line(s: Stmt) -> str:
    where = ", ".join(cite(c) for c in s.cites)
    note = "; ".join(x for x in (s.note, where) if x)
    return f"{s.code}  # {note}" if note else s.code


def _legend(stmts: Sequence[Stmt]) -> list[str]:
    seen: dict[str, Span] = {}
    for s in stmts:
        for c in s.cites:
            seen.setdefault(cite(c), c)
    if not seen:
        return []
    lines = ["# Plan lines cited below:"]
    for key, span in sorted(seen.items(), key=lambda kv: (kv[1].file, kv[1].line, kv[1].column)):
        lines.append(f"#   {key}  {_source_line(span)}".rstrip())
    return lines


def _source_line(span: Span) -> str:
    text = source_text(span.file)
    if text is None:
        return ""
    lines = text.splitlines()
    return lines[span.line - 1].strip() if 0 < span.line <= len(lines) else ""

