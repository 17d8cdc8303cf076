"""The per-rank program as Python source: a walker of the lowered program that writes code.

``generate_rank(m, rank, provenance)`` walks the rank's lowered program (``ssdsl.lower``) with the
same visitor as every backend; its handlers write one statement per instruction instead of
running it. A local ATen call becomes that call on the rank's values (``v['name']``, the names
of the program); every other instruction (taking a shard, communication, a unit boundary, a
backward segment, a gradient bucket, the optimizer step...) is a module-level constant in the
program's text form, handed to the runtime as it is (``rt(I12)``); a recomputed region becomes a
nested function run under ``rt.recompute``. Each statement ends with a comment naming what it does
and the plan lines behind it; the module's head lists those lines with their text. So the module
covers the whole step (forward, backward, reducers, optimizer), pipelines and recompute included,
and nothing is decided here that the program does not already say.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

import ssdsl
from ssdsl.codegen.text import literal, region_text
from ssdsl.errors import SsdslError
from ssdsl.gcpause import gc_paused
from ssdsl.lower import Handler, Program, lower_rank, walk
from ssdsl.lower.build import classes_of, context_of
from ssdsl.lower.instr import Call, Coll, P2P
from ssdsl.lower.text import field_texts, text_of_fields
from ssdsl.materialize.program import Materialized
from ssdsl.source import Span, source_text

# The first line of every generated file starts with this; ``write`` refuses to replace a file
# that does not, so a compile never clobbers a hand-written module.
GENERATED_MARK = "# ssdsl-generated: do not edit"


class NotGeneratable(SsdslError):
    """The plan needs something code generation does not write."""


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
    """One line of ``train_step``: code, a short note, the plan positions behind it, depth."""

    code: str
    note: str = ""
    cites: tuple[Span, ...] = ()
    depth: int = 1


def cite(span: Span) -> str:
    """``megatron_tp.ssp:20:1``: a plan position without the directory (deterministic)."""
    return f"{_file_name(span.file)}:{span.line}:{span.column}"


@functools.lru_cache(maxsize=256)
def _file_name(path: str) -> str:  # a plan has a few files; its citations number millions
    return Path(path).name


@attrs.define
class _Done:
    """What visiting one instruction wrote (to be taken as it is for the very same instruction
    at the same place of another rank's program: a program stamped from another shares most of
    its instructions with it, ``ssdsl.lower.classes``)."""

    ins: Any
    n_consts: int  # constants before it
    depth: int
    stmts: tuple[Stmt, ...]
    consts: tuple[str, ...]
    fields: tuple[str | None, ...] | None  # its constant's field texts
    lines: tuple[str, ...] = ()


# instructions whose handlers change the writer's state beyond the lines they add (a shard
# table entry: ``param``, replayed when its lines are taken)
_STATEFUL = frozenset({"recompute", "end_recompute"})


class _Emitter(Handler):
    """The code-writing handlers of the one walk. ``like``: what the walk of a program of the
    same class wrote, instruction by instruction (``_Done``): taken for every instruction that
    is the same object at the same place, and field by field for the others."""

    def __init__(self, m: Materialized, program: Program,
                 like: list[_Done] | None = None, *, notes: dict[int, tuple]) -> None:
        self.m, self.program = m, program
        self.graph = m.transformed.graph
        shared = context_of(m)  # made once per plan, not once per rank
        # (op, device) -> the op's parts there: several under co-shard, told apart by index
        self.placed = shared.placed
        self.edges = shared.edge_keys
        self.stmts: list[Stmt] = []
        self.consts: list[str] = []
        self.shards: list[tuple[str, str, str]] = []
        self._shard_set: set[tuple[str, str, str]] = set()  # every micro-batch takes them again
        self.depth = 1
        self.regions: list[tuple[str, str]] = []
        self._wheres: dict[tuple, tuple[str, tuple[Span, ...]]] = {}
        self.like = like
        self.record = like is None  # what this walk writes serves the rest of the class
        self.done: list[_Done] = []
        self.lines: list[str | None] = []  # the finished line of each statement, where known
        self._hit: _Done | None = None
        self._fields: tuple[str | None, ...] | None = None
        self._i = 0
        self._parts = notes
        self._edge_names: dict[int, str] = {}

    def visit(self, ins: Any) -> None:
        i = self._i
        self._i = i + 1
        n, depth, s = len(self.consts), self.depth, len(self.stmts)
        like = self.like
        hit = self._hit = like[i] if like is not None and i < len(like) else None
        self._fields = None
        if hit is not None and hit.ins is ins and hit.n_consts == n and hit.depth == depth \
                and ins.kind not in _STATEFUL:
            self.stmts += hit.stmts
            self.consts += hit.consts
            self.lines += hit.lines
            if ins.kind == "param":
                self._shard(ins)
            return
        getattr(self, "on_" + ins.kind)(ins)
        self.lines += [None] * (len(self.stmts) - len(self.lines))
        if self.record:
            self.done.append(_Done(ins, n, depth, tuple(self.stmts[s:]),
                                   tuple(self.consts[n:]), self._fields))

    def _const(self, ins: Any) -> str:
        name = f"I{len(self.consts)}"
        hit = self._hit
        texts = field_texts(ins, without_span=True, like=(hit.ins, hit.fields)
                            if hit is not None and hit.fields is not None else None)
        self._fields = texts
        self.consts.append(f"{name} = {text_of_fields(ins, texts)}")
        return name

    def _hand(self, ins: Any, note: str, *extra: Span | None) -> None:
        self.stmts.append(Stmt(f"rt({self._const(ins)})", note, _spans(ins.span, *extra),
                               self.depth))

    # -- units and values -------------------------------------------------------------------------
    def on_begin(self, ins) -> None:
        self._hand(ins, f"unit {ins.unit} begins")

    def on_end(self, ins) -> None:
        self._hand(ins, f"unit {ins.unit} ends")

    def on_input(self, ins) -> None:
        self._hand(ins, f"{ins.out} = batch[{ins.index}] {region_text(ins.region)}")

    def on_param(self, ins) -> None:
        _, qual, region = self._shard(ins)
        scale = f" x{ins.scale:g}" if ins.scale != 1.0 else ""
        self._hand(ins, f"{ins.out} = shard of {qual} {region}{scale}")

    def _shard(self, ins) -> tuple[str, str, str]:
        """Enter the shard ``ins`` takes into the shard table (once)."""
        qual = self.graph.params.get(ins.tensor, ins.tensor)
        entry = (ins.tensor, qual, region_text(ins.region))
        if entry not in self._shard_set:
            self._shard_set.add(entry)
            self.shards.append(entry)
        return entry

    def on_buffer(self, ins) -> None:
        qual = self.graph.buffers.get(ins.tensor, "constant")
        self._hand(ins, f"{ins.out} = {qual} {region_text(ins.region)}")

    def on_call(self, ins) -> None:
        where, spans, note = self._where(ins)
        hit = self._hit
        if hit is not None and hit.stmts and type(hit.ins) is Call and hit.ins.ins is ins.ins \
                and hit.ins.outs is ins.outs and hit.ins.loss == ins.loss \
                and hit.ins.count == ins.count and hit.ins.listy == ins.listy \
                and (hit.ins.call is ins.call or _call_pieces(hit.ins.call, ins.listy)
                     == _call_pieces(ins.call, ins.listy)):
            # the same call on the same values (a part of another index): the same code
            first = hit.stmts[0]
            code = first.code
            # the statement serves the legend (its plan lines) and its line is written here:
            # the first module's statement does when the plan lines are the same
            self.stmts.append(first if first.cites == spans and first.depth == self.depth
                              else Stmt(code, where, spans, self.depth))
            self.lines.append(f"{'    ' * self.depth}{code}  # {note}")
            if ins.loss:
                self.stmts.append(Stmt(hit.stmts[1].code, "a loss part", spans, self.depth))
            return
        lc = ins.call
        pieces = _call_pieces(lc, ins.listy)  # one per call object: every micro-batch shares it
        rhs = "".join(x if type(x) is str else f"v[{ins.ins[x]!r}]" for x in pieces)
        outs = [f"v[{o!r}]" for o in ins.outs]
        if ins.listy:
            lhs = ", ".join(outs) + ("," if len(outs) == 1 else "")
        else:
            lhs = outs[0]
        self.stmts.append(Stmt(f"{lhs} = {rhs}", where, spans, self.depth))
        if ins.loss:
            self.stmts.append(Stmt(f"rt.loss({outs[0]}, {ins.count!r})", "a loss part", spans,
                                   self.depth))

    def _where(self, ins) -> tuple[str, tuple[Span, ...], str]:
        """The note and plan lines of a call of part ``ins.part`` of ``ins.op``, and the
        comment they make (asked again by every micro-batch: found once per rank)."""
        key = (ins.op, ins.part)  # a part's calls share one span object
        found = self._wheres.get(key)
        if found is not None and found[0] is ins.span:
            return found[1]
        part = next((p for p in self.placed.get((ins.op, self.program.rank), ())
                     if p.index == ins.part), None)
        found = self._parts.get(id(part)) if part is not None else None
        if found is None or found[0] is not part:
            op = self.graph.op(ins.op)
            where = f"{op.module or '(top)'} part {_index(part) if part else ins.part}"
            spans = _spans(part.span, part.assigned_at) if part else _spans(ins.span)
            cites = _cites(spans)
            found = (part, where, spans, f"{where}; {cites}" if cites else where)
            if part is not None:  # a part's note is the same on every rank
                self._parts[id(part)] = found
        self._wheres[key] = (ins.span, found[1:])
        return found[1:]

    def on_cut(self, ins) -> None:
        self._hand(ins, f"{ins.out} = {ins.src} cut from its segment")

    def on_free(self, ins) -> None:
        self._hand(ins, f"free {len(ins.values)} values")

    def on_local(self, ins) -> None:
        self._hand(ins, f"{self._edge(ins.edge)}: local {_steps_text(ins.steps)}")

    # -- communication and backward -------------------------------------------------------------
    def on_comm(self, ins) -> None:
        way = "backward" if ins.backward else "forward"
        self._hand(ins, f"{self._edge(ins.edge)} mb {ins.mb} {way}: {_steps_text(ins.steps)}")

    def _edge(self, i: int) -> str:
        found = self._edge_names.get(i)
        if found is None:
            tensor, op, slot = self.edges[i]
            found = self._edge_names[i] = f"{tensor} -> {op}[{slot}]"
        return found

    def on_backward(self, ins) -> None:
        self._hand(ins, f"backward of a segment from {len(ins.seeds)} loss part(s) and "
                   f"{len(ins.roots)} received gradient(s)")

    def on_backward_input(self, ins) -> None:
        self._hand(ins, f"input-gradient half of a segment's backward from {len(ins.seeds)} loss "
                   f"part(s) and {len(ins.roots)} received gradient(s)")

    def on_backward_weight(self, ins) -> None:
        self._hand(ins, f"weight-gradient half of a segment's backward through {len(ins.mixes)} "
                   "weight cut call(s)")

    def on_recompute(self, ins) -> None:
        name = f"recomputed_{len(self.regions)}"
        self.regions.append((name, self._const(ins)))
        self.stmts.append(Stmt(f"def {name}(v):", "recomputed in backward", _spans(ins.span),
                               self.depth))
        self.depth += 1

    def on_end_recompute(self, ins) -> None:
        self.depth -= 1
        name, const = self.regions[-1]
        self.stmts.append(Stmt(f"rt.recompute({const}, {name})", "keeps no activations",
                               _spans(ins.span), self.depth))

    def on_wait_sends(self, ins) -> None:
        self._hand(ins, "wait for the sends in flight")

    def on_reduce(self, ins) -> None:
        zero = f" (ZeRO stage {ins.zero}: this rank steps its chunk)" if ins.zero else ""
        self._hand(ins, f"{ins.collective} {len(ins.entries)} weight gradients over "
                   f"{ins.group}" + (", and the step's loss" if ins.loss else "") + zero)

    def on_gather(self, ins) -> None:
        self._hand(ins, f"all_gather the stepped chunks of {len(ins.entries)} weights over "
                   f"{ins.group}")

    def on_gather_params(self, ins) -> None:
        self._hand(ins, f"ZeRO-3: start the all_gather of {len(ins.entries)} weights (bucket "
                   f"{ins.bucket}) over {ins.group}")

    def on_wait_params(self, ins) -> None:
        self._hand(ins, f"ZeRO-3: wait for the weights of bucket {ins.bucket}")

    def on_free_params(self, ins) -> None:
        self._hand(ins, f"ZeRO-3: free the gathered weights of bucket {ins.bucket}")

    def on_loss_sum(self, ins) -> None:
        self._hand(ins, "the step's loss: all_reduce over every rank" if len(ins.group) > 1
                   else "the step's loss: this rank's own parts (every rank holds all of it)")

    def on_step(self, ins) -> None:
        self._hand(ins, "optimizer step on this rank's shards")


# A call's right-hand side as text pieces and slot numbers (where ``v[name]`` of the input goes),
# made once per call object (kept alive with its pieces, so that its id is not reused while
# cached; calls compare equal across texts, ``1 == 1.0``, so they are cached by identity).
_CALL_PIECES: dict[tuple[int, bool], tuple[Any, tuple[str | int, ...]]] = {}
_SLOT_MARK = "\x00"  # never in a literal's text: repr escapes it


def _call_pieces(lc: Any, listy: bool) -> tuple[str | int, ...]:
    hit = _CALL_PIECES.get((id(lc), listy))
    if hit is not None and hit[0] is lc:
        return hit[1]
    slots: list[int] = []

    def mark(i: int) -> str:
        slots.append(i)
        return _SLOT_MARK

    args = [literal(x, mark) for x in lc.args] + [f"{k}={literal(x, mark)}" for k, x in lc.kwargs]
    target = "aten.reshape.default" if lc.target == "aten.view.default" else lc.target
    # (a view of a received activation may not alias its input; reshape gives the same values)
    ns, _, rest = target.partition(".")
    fn = f"aten.{rest}" if ns == "aten" else f"torch.ops.{target}"
    call = f"{fn}({', '.join(args)})"
    if lc.scale != 1.0:
        call = f"(o * {lc.scale!r} for o in {call})" if listy else f"{call} * {lc.scale!r}"
    texts = call.split(_SLOT_MARK)
    if len(texts) != len(slots) + 1:
        raise AssertionError(f"a call's text holds the slot mark: {call!r}")
    pieces: list[str | int] = [texts[0]]
    for i, text in zip(slots, texts[1:]):
        pieces += [i, text]
    if len(_CALL_PIECES) >= 1 << 16:
        _CALL_PIECES.clear()
    _CALL_PIECES[(id(lc), listy)] = (lc, tuple(pieces))
    return tuple(pieces)


def _steps_text(steps: Sequence[Any]) -> str:
    parts = []
    for s in steps:
        if isinstance(s, Coll):
            extra = "".join(f" {k}={getattr(s, k)}" for k in ("dim", "cat_dim", "split_dim")
                            if getattr(s, k))
            parts.append(f"{s.kind}{extra} over {s.group}")
        elif isinstance(s, P2P):
            sends = [m.peer for m in s.msgs if m.kind == "send"]
            recvs = [m.peer for m in s.msgs if m.kind == "recv"]
            text = []
            if sends:
                text.append(f"send to {sorted(set(sends))}")
            if recvs:
                text.append(f"receive from {sorted(set(recvs))}")
            parts.append(" and ".join(text) or "local copy")
    return ", then ".join(parts) or "nothing moves"


def _index(part: Any) -> str:
    if not part.index:
        return "whole"
    return "(" + ", ".join(f"{'r' if r else ''}{i}" for i, r in zip(part.index, part.replica)) + ")"


def _spans(*spans: Span | None) -> tuple[Span, ...]:
    out: list[Span] = []
    for s in spans:
        if s is not None and s not in out:
            out.append(s)
    return tuple(out)


# -- the module ------------------------------------------------------------------------------


@gc_paused()
def generate_rank(m: Materialized, rank: int, prov: Provenance,
                  program: Program | None = None, *, reuse: bool = True) -> str:
    """The Python module of ``rank``: header, shard table, cited plan lines, instruction
    constants, ``train_step``.

    With ``reuse`` (the default), what was written for the first rank of the same class
    (``ssdsl.lower.classes``) is taken for every instruction object the two programs share;
    without, everything is written afresh (the same text)."""
    program = program if program is not None else lower_rank(m, rank, direct=not reuse)
    done = _renderings(m) if reuse else {}
    rep = classes_of(m).rep_of.get(rank, rank) if reuse else rank
    e = _Emitter(m, program, done.get(rep), notes=_part_notes(m) if reuse else {})
    for _ in walk(e.program, e):
        raise AssertionError("the code writer never waits")
    # the plan lines a class's modules cite are the same: each statement's lines come from its
    # instruction's span and its part's, which the class key holds (``ssdsl.lower.classes``)
    legends = _legends(m) if reuse else {}
    legend = legends.get(rep)
    if legend is None:
        legend = _legend(e.stmts)
        if reuse:
            legends[rep] = legend
    body = _body(e, legend)
    if rep not in done:
        k = 0
        for d in e.done:
            d.lines = tuple(e.lines[k:k + len(d.stmts)])
            k += len(d.stmts)
        done[rep] = e.done
    return _header(rank, prov, body) + body


_RENDERED: list[tuple[Materialized, dict[int, list[_Done]]]] = []
_LEGENDS: list[tuple[Materialized, dict[int, list[str]]]] = []
_PART_NOTES: list[tuple[Materialized, dict[int, tuple]]] = []


def _part_notes(m: Materialized) -> dict[int, tuple]:
    """id(part) -> (part, note, plan lines, comment) of ``m``'s parts, once asked."""
    if not (_PART_NOTES and _PART_NOTES[0][0] is m):
        _PART_NOTES[:] = [(m, {})]
    return _PART_NOTES[0][1]


def _legends(m: Materialized) -> dict[int, list[str]]:
    """The legend of the plan lines cited by each class of ``m`` (the plan written last)."""
    if not (_LEGENDS and _LEGENDS[0][0] is m):
        _LEGENDS[:] = [(m, {})]
    return _LEGENDS[0][1]


def _renderings(m: Materialized) -> dict[int, list[_Done]]:
    """What was written for the first rank of each class of ``m`` (the plan written last)."""
    if not (_RENDERED and _RENDERED[0][0] is m):
        _RENDERED[:] = [(m, {})]
    return _RENDERED[0][1]


def rank_order(m: Materialized):
    """A sort key of file stems (``rank12``) that puts the ranks of one class together: by the
    schedule program a rank runs (a class never spans two), then by its class where its program
    was lowered already. ``write_programs(..., order=rank_order(m))`` hands each class to one
    writing process, so each class's first module is written once, not once per process."""
    found = classes_of(m)
    groups, rep_of = found.index.unit_group, found.rep_of

    def key(stem: str) -> tuple[int, int]:
        digits = stem.removeprefix("rank")
        if not digits.isdigit():
            return (-1, -1)
        r = int(digits)
        return (groups.get(r, -1), rep_of.get(r, -1))
    return key


def generate_all(m: Materialized, prov: Provenance) -> dict[str, str]:
    """``{"rank0.py": text, ...}`` for every rank of the world."""
    return {f"rank{r}.py": generate_rank(m, r, prov) for r in range(prov.world)}


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
        "Generated by ssdsl from this rank's lowered program (`ssdsl check MODEL PLAN --program\n"
        f"{rank}` prints it). ``train_step(rt, v)`` is the rank's whole training step in order:\n"
        "local ATen calls on the values ``v``, and the program's other instructions (I0, I1...)\n"
        "handed to ``rt`` (``ssdsl.runtime.compiled.Runtime``) as they are.\n"
        '"""\n\n'
        "import torch\n\n"
        "from ssdsl.codegen.prelude import *  # noqa: F403 - the instruction constructors\n\n"
        "aten = torch.ops.aten\n\n"
        f"RANK = {rank}\nWORLD = {prov.world}\n"
        f"PLAN = {prov.plan!r}\nPLAN_FILE = {prov.plan_file!r}\n"
        f"PLAN_PARAMS = {dict(prov.params)!r}\n"
        f"MODEL_FILE = {prov.model!r}\nSSDSL_VERSION = {prov.version!r}\n"
        f"DIGEST = {body_digest(body)!r}\n")


def _body(e: _Emitter, legend: list[str]) -> str:
    lines = [_BODY_START.lstrip("\n") + "-" * 80, "# Parameter shards this rank holds: "
             "(graph tensor, qualified name, region).", "SHARDS = ("]
    lines += [f"    {s!r}," for s in e.shards]
    lines += [")", ""]
    lines += legend
    lines += ["", "# The program's instructions that the runtime runs as they are."]
    lines += e.consts
    lines += ["", "", "def train_step(rt, v):"]
    made = e.lines
    for k, s in enumerate(e.stmts):
        if made[k] is None:
            made[k] = "    " * s.depth + _line(s)
    lines += made
    lines += [""]
    return "\n" + "\n".join(lines)


def _line(s: Stmt) -> str:
    where = _cites(s.cites)
    note = "; ".join(x for x in (s.note, where) if x)
    return f"{s.code}  # {note}" if note else s.code


@functools.lru_cache(maxsize=1 << 12)
def _cites(spans: tuple[Span, ...]) -> str:  # equal spans have equal positions: equal text
    return ", ".join(cite(c) for c in spans)


def _legend(stmts: Sequence[Stmt]) -> list[str]:
    seen: dict[str, Span] = {}
    distinct = {id(s.cites): s.cites for s in stmts}  # statements share their spans' tuples
    for cites in distinct.values():
        for c in cites:
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
