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
import operator
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
from ssdsl.lower.instr import Call, Coll, Comm, P2P, TakeBuffer, TakeInput, TakeParam
from ssdsl.lower.text import _lit, field_texts, text_of_fields
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


# instructions whose handlers change the writer's state beyond the lines they add (the depth,
# the recomputed regions): a template does not write one of them again alone
_STATEFUL = frozenset({"recompute", "end_recompute"})


class _Emitter(Handler):
    """The code-writing handlers of the one walk. With ``record``, what each instruction wrote
    is kept (``done``: a class's template, ``_Template``). ``_hit``: where a template's
    instruction at the same place is written again for another rank, what it wrote there (its
    constant's field texts are taken where the values are the same)."""

    def __init__(self, m: Materialized, program: Program, *, notes: dict[int, tuple],
                 record: bool = False) -> None:
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
        self.record = record
        self.done: list[_Done] = []
        self._hit: _Done | None = None
        self._fields: tuple[str | None, ...] | None = None
        self._parts = notes
        self._edge_names: dict[int, str] = {}
        self._base = 0  # constants written before this emitter's first (``_Template.fill``)

    def visit(self, ins: Any) -> None:
        n, depth, s = len(self.consts), self.depth, len(self.stmts)
        self._fields = None
        getattr(self, "on_" + ins.kind)(ins)
        if self.record:
            self.done.append(_Done(ins, n, depth, tuple(self.stmts[s:]),
                                   tuple(self.consts[n:]), self._fields))

    def _const(self, ins: Any) -> str:
        name = f"I{self._base + len(self.consts)}"
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

    def _shard_entry(self, ins) -> tuple[str, str, str]:
        """The shard table's entry of the shard ``ins`` takes."""
        return (ins.tensor, self.graph.params.get(ins.tensor, ins.tensor), region_text(ins.region))

    def _shard(self, ins) -> tuple[str, str, str]:
        """Enter the shard ``ins`` takes into the shard table (once)."""
        entry = self._shard_entry(ins)
        if entry not in self._shard_set:
            self._shard_set.add(entry)
            self.shards.append(entry)
        return entry

    def on_buffer(self, ins) -> None:
        qual = self.graph.buffers.get(ins.tensor, "constant")
        self._hand(ins, f"{ins.out} = {qual} {region_text(ins.region)}")

    def on_call(self, ins) -> None:
        where, spans, _ = self._where(ins)
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
        what = {"whole": "backward of a segment",
                "sent": "first walk of a segment's backward (the gradients it sends on)",
                "rest": "second walk of a segment's backward (the weights' gradients)"}[ins.part]
        self._hand(ins, f"{what} from {len(ins.seeds)} loss part(s) and "
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


# equal pieces are one tuple (``_Template.fill`` compares them by identity)
_PIECES: dict[tuple[str | int, ...], tuple[str | int, ...]] = {}
_CALL_PIECES_MAX = _PIECES_MAX = 1 << 16  # entries each cache holds before it is cleared


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
    # the call objects are many (a part's own on every rank) and their cache is cleared when
    # full; the texts are few (one per distinct call of the graph), and clearing them would make
    # every template's pieces (``_Template.heads``) differ by identity from a new call's, so
    # that each later call of a 1,024-rank compile is written the slow way
    if len(_CALL_PIECES) >= _CALL_PIECES_MAX:
        _CALL_PIECES.clear()
    if len(_PIECES) >= _PIECES_MAX:
        _PIECES.clear()
    found = _PIECES.setdefault(tuple(pieces), tuple(pieces))
    _CALL_PIECES[(id(lc), listy)] = (lc, found)
    return found


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


# The instructions a member of a class often differs from its template in one field alone:
# class -> (that field, a getter of the other fields, how its note writes that field). The
# field has no default, so that every constant writes it.
def _one(cls: type, name: str, noted: Any) -> tuple:
    fields = attrs.fields(cls)
    if getattr(fields, name).default is not attrs.NOTHING:
        raise AssertionError(f"{cls.__name__}.{name} has a default: a constant may leave it out")
    return name, operator.attrgetter(*(f.name for f in fields if f.name != name)), noted


_ONE_FIELD: dict[type, tuple] = {
    Comm: _one(Comm, "steps", _steps_text),
    TakeParam: _one(TakeParam, "region", region_text),
    TakeInput: _one(TakeInput, "region", region_text),
    TakeBuffer: _one(TakeBuffer, "region", region_text),
}


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

    With ``reuse`` (the default), the module of the first rank of the same class
    (``ssdsl.lower.classes``) written in this process is its template: every instruction object
    the two programs share keeps its text there, and only the others (the stamped ones) are
    written (``_Template``); without, everything is written afresh (the same text)."""
    program = program if program is not None else lower_rank(m, rank, direct=not reuse)
    rep = classes_of(m).rep_of.get(rank, rank) if reuse else rank
    if reuse:
        template = _templates(m).get(rep)
        if template is not None:
            body = template.fill(m, program)
            if body is not None:
                return _header(rank, prov, body) + body
    e = _Emitter(m, program, notes=_part_notes(m) if reuse else {}, record=reuse)
    for _ in walk(e.program, e):
        raise AssertionError("the code writer never waits")
    # the plan lines a class's modules cite are the same: each statement's lines come from its
    # instruction's span and its part's, which the class key holds (``ssdsl.lower.classes``)
    legend = _legend(e.stmts)
    lines = _lines(e.stmts)
    body = _body(e.shards, legend, e.consts, lines)
    if reuse:
        _templates(m)[rep] = _Template.of(program, e, legend, lines)
    return _header(rank, prov, body) + body


class _Template:
    """The module of one rank of a class, as the modules of the others are made from it.

    A rank of the class has the same instructions at the same places, up to the stamped fields
    (``ssdsl.lower.classes``); an instruction object the two programs share has the same text
    at the same place (its statements' lines, its constants), since the plan lines and part
    notes behind it are in the class key too. So another rank's module is this one with the
    constants and lines of the instructions that differ written again, by the same handlers,
    at the same constant numbers and depth."""

    def __init__(self, instructions: tuple, done: list[_Done], consts: list[str],
                 lines: list[str], shards: list, legend: list[str]) -> None:
        self.instructions, self.done = instructions, done
        self.consts, self.lines, self.shards, self.legend = consts, lines, shards, legend
        starts, k = [], 0
        for d in done:
            starts.append(k)
            k += len(d.stmts)
        self.starts = starts  # each instruction's first statement
        self.params = [i for i, ins in enumerate(instructions) if ins.kind == "param"]
        self.heads: dict[int, tuple] = {}  # a call's line up to its note, once asked
        self.ones: dict[int, tuple[str, ...]] = {}  # ``_one_field_pieces``, once asked
        self._groups: tuple | None = None  # ``_call_groups``, once asked
        # texts of stamped values and shard entries, kept across the class's ranks (the same
        # region objects recur: a tensor-parallel shard on every data-parallel rank)
        self.texts: dict[int, tuple] = {}  # id(value) -> (value, its text, its note's)
        self.shard_entries: dict[tuple, tuple] = {}  # (tensor, id(region)) -> (region, entry)

    def _call_groups(self) -> tuple[tuple, tuple[int, ...]]:
        """The calls of one line (not a loss part), grouped by their part and local call (the
        micro-batches of one part: their lines differ before the note, and share the note):
        per group the positions, each one's line up to its note, the local call and its code's
        pieces; and the positions in no group."""
        if self._groups is None:
            found: dict[tuple, list[int]] = {}
            for i, (d, ins) in enumerate(zip(self.done, self.instructions)):
                if type(ins) is Call and not ins.loss and len(d.stmts) == 1 and not d.consts:
                    found.setdefault((ins.op, ins.part, id(ins.call), ins.listy), []).append(i)
            grouped = [False] * len(self.instructions)
            groups = []
            for positions in found.values():
                first = self.instructions[positions[0]]
                heads = tuple(f"{'    ' * self.done[i].depth}{self.done[i].stmts[0].code}  # "
                              for i in positions)
                groups.append((tuple(positions), heads, first.call,
                               _call_pieces(first.call, first.listy)))
                for i in positions:
                    grouped[i] = True
            loose = tuple(i for i, g in enumerate(grouped) if not g)
            self._groups = (tuple(groups), loose)
        return self._groups

    def _one_field_pieces(self, i: int, one: tuple) -> tuple[str, ...]:
        """The constant and the line of the instruction at ``i`` before and after the text of
        its stamped field ``one[0]`` and of that field in its note (``one[2]``); empty where
        either does not occur exactly once there (the handler writes such a one)."""
        d = self.done[i]
        name, _, noted = one
        if len(d.consts) != 1 or len(d.stmts) != 1:
            return ()
        value = getattr(d.ins, name)
        field, note = f"{name}={_lit(value)}", noted(value)
        const, line = self.consts[d.n_consts], self.lines[self.starts[i]]
        if const.count(field) != 1 or line.count(note) != 1:
            return ()
        const_head, const_tail = const.split(field)
        line_head, line_tail = line.split(note)
        return const_head + f"{name}=", const_tail, line_head, line_tail

    @classmethod
    def of(cls, program: Program, e: _Emitter, legend: list[str], lines: list[str]
           ) -> _Template:
        return cls(program.instructions, e.done, e.consts, lines, e.shards, legend)

    def fill(self, m: Materialized, program: Program) -> str | None:
        """The body of ``program``'s module, or None where its instructions do not line up
        with this template's (the caller then walks it whole)."""
        mine, base = program.instructions, self.instructions
        if len(mine) != len(base):
            return None
        e = _Emitter(m, program, notes=_part_notes(m))
        consts, lines, done, starts = list(self.consts), list(self.lines), self.done, self.starts
        heads, ones = self.heads, self.ones
        seen = self.texts
        pieces_of, is_ = _call_pieces, operator.is_
        groups, loose = self._call_groups()
        # a part's calls (one per micro-batch) as a group: the same code before the note where
        # each differs from the template's only in the part, on the same local call (or one of
        # the same code); the note, this rank's part's, is found once
        rest: list[int] = []
        for positions, line_heads, was_call, was_pieces in groups:
            first = None
            for i in positions:
                if mine[i] is not base[i]:
                    first = mine[i]
                    break
            if first is None:
                continue
            ok = type(first) is Call and (first.call is was_call or pieces_of(
                first.call, first.listy) is was_pieces)
            if ok:
                op, part, call, span = first.op, first.part, first.call, first.span
                for i in positions:
                    ins, was = mine[i], base[i]
                    if ins is not was and not (
                            type(ins) is Call and ins.call is call and ins.part == part
                            and ins.span is span and ins.op == op and ins.ins is was.ins
                            and ins.outs is was.outs and ins.listy == was.listy
                            and ins.loss == was.loss and ins.count == was.count):
                        ok = False
                        break
            if not ok:
                rest.extend(i for i in positions if mine[i] is not base[i])
                continue
            note = e._where(first)[2]
            for i, head in zip(positions, line_heads):
                if mine[i] is not base[i]:
                    lines[starts[i]] = head + note
        changed = [i for i in loose if mine[i] is not base[i]]
        changed += rest
        for i in changed:
            d, ins = done[i], mine[i]
            cls, was = type(ins), d.ins
            if cls is Call and type(was) is Call and was.ins is ins.ins and was.outs is ins.outs \
                    and was.loss == ins.loss and was.count == ins.count \
                    and was.listy == ins.listy:
                head = heads.get(i)
                if head is None:  # the template's line up to its note, and its code's pieces
                    head = heads[i] = (f"{'    ' * d.depth}{d.stmts[0].code}  # ",
                                       pieces_of(was.call, was.listy))
                if was.call is ins.call or pieces_of(ins.call, ins.listy) is head[1]:
                    # the same code on a part of another index: the note names this rank's part
                    _, spans, note = e._where(ins)
                    k = starts[i]
                    lines[k] = head[0] + note
                    if ins.loss:
                        lines[k + 1] = "    " * d.depth + _line(
                            Stmt(d.stmts[1].code, "a loss part", spans, d.depth))
                    continue
            one = _ONE_FIELD.get(cls)
            if one is not None and type(was) is cls \
                    and all(map(is_, one[1](ins), one[1](was))):
                # only the stamped field differs (peers and tags, a region): its text goes
                # between the template's pieces of the constant and of the line
                pieces = ones.get(i)
                if pieces is None:
                    pieces = ones[i] = self._one_field_pieces(i, one)
                value = getattr(ins, one[0])
                if pieces:
                    texts = seen.get(id(value))
                    if texts is None or texts[0] is not value:
                        texts = seen[id(value)] = (value, _lit(value), one[2](value))
                    const_head, const_tail, line_head, line_tail = pieces
                    consts[d.n_consts] = const_head + texts[1] + const_tail
                    lines[starts[i]] = line_head + texts[2] + line_tail
                    continue
            if ins.kind in _STATEFUL or cls is not type(was):
                return None
            e.stmts, e.consts, e.depth, e._base = [], [], d.depth, d.n_consts
            e._hit = d
            e._fields = None
            getattr(e, "on_" + ins.kind)(ins)
            if len(e.consts) != len(d.consts) or len(e.stmts) != len(d.stmts):
                return None
            if e.consts:
                consts[d.n_consts:d.n_consts + len(e.consts)] = e.consts
            k = starts[i]
            for j, s in enumerate(e.stmts):
                lines[k + j] = "    " * s.depth + _line(s)
        shards = self.shards
        if any(mine[i] is not base[i] for i in self.params):
            # ``_Emitter._shard`` of each, an entry found once per region object
            entries, shards, got = self.shard_entries, [], set()
            for i in self.params:
                ins = mine[i]
                region = ins.region
                hit = entries.get((ins.tensor, id(region)))
                if hit is None or hit[0] is not region:
                    hit = entries[(ins.tensor, id(region))] = (region, e._shard_entry(ins))
                if hit[1] not in got:
                    got.add(hit[1])
                    shards.append(hit[1])
        return _body(shards, self.legend, consts, lines)


_TEMPLATES: list[tuple[Materialized, dict[int, _Template]]] = []
_PART_NOTES: list[tuple[Materialized, dict[int, tuple]]] = []


def _part_notes(m: Materialized) -> dict[int, tuple]:
    """id(part) -> (part, note, plan lines, comment) of ``m``'s parts, once asked."""
    if not (_PART_NOTES and _PART_NOTES[0][0] is m):
        _PART_NOTES[:] = [(m, {})]
    return _PART_NOTES[0][1]


def _templates(m: Materialized) -> dict[int, _Template]:
    """The template of each class of ``m`` (the plan written last), once one of its ranks was
    written in this process."""
    if not (_TEMPLATES and _TEMPLATES[0][0] is m):
        _TEMPLATES[:] = [(m, {})]
    return _TEMPLATES[0][1]


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


def _lines(stmts: Sequence[Stmt]) -> list[str]:
    """Each statement's line of ``train_step``."""
    return ["    " * s.depth + _line(s) for s in stmts]


def _body(shards: Sequence[tuple[str, str, str]], legend: list[str], consts: list[str],
          lines: list[str]) -> str:
    out = [_BODY_START.lstrip("\n") + "-" * 80, "# Parameter shards this rank holds: "
           "(graph tensor, qualified name, region).", "SHARDS = ("]
    out += [f"    {s!r}," for s in shards]
    out += [")", ""]
    out += legend
    out += ["", "# The program's instructions that the runtime runs as they are."]
    out += consts
    out += ["", "", "def train_step(rt, v):"]
    out += lines
    out += [""]
    return "\n" + "\n".join(out)


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
