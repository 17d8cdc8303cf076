"""Applying partition, replicate and assign directives to a graph, in plan order."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

import attrs

from ssdsl.elaborate.directives import Assign, Partition, Replicate, StageRef
from ssdsl.errors import ErrorCollector, SsdslError
from ssdsl.ir.graph import Graph
from ssdsl.ops import (
    Annotation, FrozenDimError, NotAnnotated, NotAnnotatedError, annotate, call_of, require,
)
from ssdsl.source import Span
from ssdsl.transform.errors import (
    BadDevice, MissingDim, NoSuchParts, PartCountMismatch,
    PartReassigned, UnplacedPart,
)
from ssdsl.transform.normalize import normalize_losses
from ssdsl.transform.parts import Part, Transformed, row_major, split_ranges, whole_part
from ssdsl.trace.table import plan_word
from ssdsl.transform.select import part_prefix, select_ops


def _plan_dims(ann: Annotation) -> str:
    """The dims a plan can name, as it writes them: the flowing name or word (``batch``,
    ``heads``, ``out``) else the label with factors as ``k_1``; frozen dims left out."""
    words = {label: word for word, label in ann.words.items()}
    names = [plan_word(ann.names.get(n) or words.get(n) or n)
             for n, lab in ann.labels().items() if lab.mark in ("spatial", "reduced")]
    return ", ".join(dict.fromkeys(names)) or "none that can be split"



class _Builder:
    """The mutable part table, alive only while one plan is applied."""

    def __init__(self, graph: Graph, world: int, *, start: Transformed | None = None) -> None:
        self.graph = graph
        self.world = world
        self.notes: list[str] = []
        self._readers: dict | None = None  # tensor -> the ops reading it, when first needed
        # tensor -> (dim, factor position, factor sizes) of a split inner factor (``_record``)
        self._inner: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        if start is not None:  # continue from an earlier result (the schedule phase's assigns)
            self.anns = dict(start.annotations)
            self.parts = {k: list(v) for k, v in start.parts.items()}
            return
        self.anns = {op.name: annotate(graph, op) for op in graph.ops}
        self.parts: dict[str, list[Part]] = {
            op.name: [Part(op.name, (), (), (), whole_part(graph, op, self.anns[op.name]))]
            for op in graph.ops}

    # ------------------------------------------------------------------ partition
    def partition(self, d: Partition) -> None:
        prefix, base = part_prefix(d.selector)
        names = select_ops(self.graph, base, d.span)
        if all(isinstance(self.anns[n], NotAnnotated) for n in names):
            try:  # the rule's own error, naming the operator and why it has no annotation
                require(self.anns[names[0]], self.graph.op(names[0]))
            except NotAnnotatedError as err:
                err.origin = self.graph.origin(names[0])
                raise _at(err, d.span) from None
        labels = {n: self._label(n, d.dim, d.parts) for n in names}
        if len(names) > 1:  # a selection: an op that only reads the dim is an op without it
            labels = {n: None if lab is not None and self._read_only(n, lab) else lab
                      for n, lab in labels.items()}
            # ... and so is one whose positional dim of that name (``d2``: each operator's own)
            # has size 1 (the kept dim of a ``mean(-1, keepdim=True)``, a broadcast dim) while
            # other selected operators have it larger: there is nothing of it to split, and
            # `ssdsl trace` lists no such dim. A flowing dim of size 1 (one head in a stage of
            # one-head blocks) is the model's own: asked to split, it is still refused
            if any(lab is not None and self._size(n, lab) > 1 for n, lab in labels.items()):
                labels = {n: None if lab is not None and self._size(n, lab) == 1
                          and not self._flowing(n, lab) else lab
                          for n, lab in labels.items()}
        if not any(labels.values()):
            raise MissingDim(self._missing_message(names, d.dim), d.span,
                             hint=self._missing_hint(names, d.dim),
                             origin=self.graph.origin(names[0]) if len(names) == 1 else None)
        if len(names) == 1 and labels[names[0]] is None:
            raise MissingDim(self._missing_message(names, d.dim), d.span,
                             hint=self._missing_hint(names, d.dim),
                             origin=self.graph.origin(names[0]))
        # The split follows the data inside the selection: an operator without the dim whose
        # input carries a dim split here (the GELU between Megatron's two MLP linears) is split
        # along the dim that input flows into; then, backwards, one whose output feeds a dim
        # split here (the view before an HF Conv1D's addmm) is split along the dim that output
        # comes from, so the split tensor is made split instead of gathered and cut again.
        # Operators reached by no split are replicated.
        flowing: dict[str, int] = {}
        self._inner = {}
        chosen: dict[str, str | None] = {}
        for name in names:
            chosen[name] = labels[name] or self._follow(name, flowing, d.parts)
            if chosen[name] is not None:
                self._record(name, chosen[name], flowing, outer=True)
        wanted: dict[str, tuple[int, int, int]] = {}
        for name in reversed(names):
            if chosen[name] is None:
                chosen[name] = self._follow_back(name, wanted)
            if chosen[name] is not None:
                self._record_inputs(name, chosen[name], wanted)
        lacking: list[str] = []
        for name in names:
            if chosen[name] is None:
                lacking.append(name)
                self._replicate_op(name, prefix, d.parts, d.span)
            else:
                try:
                    self._split_op(name, prefix, chosen[name], d.parts, d.span)
                except FrozenDimError as err:
                    label = chosen[name]
                    if label != d.dim:  # the plan's word first, the operator's own label after
                        err.message = err.message.replace(
                            f"dimension '{label}' ", f"dimension '{d.dim}' ('{label}') ", 1)
                    if len(names) > 1:
                        err.hint = _leave_out_hint(d, self.graph.op(name).kind)
                    err.origin = self.graph.origin(name)
                    raise
        if lacking:
            self.notes.append(f"{d.span}: {len(lacking)} operator(s) without dim '{d.dim}' "
                              f"replicated into {d.parts} (e.g. '{lacking[0]}')")

    def _flowing(self, name: str, label: str) -> bool:
        """Whether ``label`` of ``name`` has a flowing name (``batch``, ``heads``, ``seq``)."""
        return label in (getattr(self.anns[name], "names", None) or {})

    def _size(self, name: str, label: str) -> int:
        ann = self.anns[name]
        assert isinstance(ann, Annotation)
        return ann.sizes()[label]

    def _read_only(self, name: str, label: str) -> bool:
        """Whether ``label`` of ``name`` is an input dim that no output has and that cannot be
        split (``x.new_ones(())`` reads only ``x``'s dtype; ``table[idx]`` looks rows up): the
        op computes nothing along it, so a selection's split leaves it whole, as it leaves an
        op without the dim; a frozen dim of an output (a batch norm's batch) is still refused."""
        ann = self.anns[name]
        assert isinstance(ann, Annotation)
        if ann.labels()[label].mark not in ("frozen", "ignored"):
            return False
        return all(f.label != label for sig in ann.outputs for dim in sig for f in dim)

    def _record(self, name: str, label: str, flowing: dict[str, int], outer: bool = False
                ) -> None:
        """Note which dim of each output of ``name`` the split ``label`` lies on (with
        ``outer``, also a dim whose outermost factor it is)."""
        ann = self.anns[name]
        op = self.graph.op(name)
        for tensor, sig in zip(op.outputs, ann.outputs):
            for dim, factors in enumerate(sig):
                # the label is the whole dim, or its outermost factor (a GroupNorm's groups):
                # either way each part holds one contiguous block of the dim
                if factors and factors[0].label == label and (outer or len(factors) == 1):
                    flowing[tensor] = dim
                elif outer and any(f.label == label for f in factors[1:]):
                    # an inner factor (the features inside the gate and up halves of a fused
                    # gate_up linear): a reader that cuts the dim alike follows that factor
                    pos = next(k for k, f in enumerate(factors) if f.label == label)
                    self._inner[tensor] = (dim, pos, tuple(f.size for f in factors))

    def _follow(self, name: str, flowing: dict[str, int], parts: int | None = None
                ) -> str | None:
        """The spatial label of ``name`` that a split input dim flows into, if any: the dim's
        label, or (given ``parts``) its outermost factor when that divides into ``parts`` (equal
        contiguous blocks of the dim, as the producer's split makes them)."""
        ann = self.anns[name]
        if isinstance(ann, NotAnnotated):
            return None
        marks = ann.labels()
        op = self.graph.op(name)
        for tensor, sig in zip(op.inputs, ann.inputs):
            dim = flowing.get(tensor)
            if dim is None or dim >= len(sig) or not sig[dim]:
                continue
            label = sig[dim][0].label
            if len(sig[dim]) > 1 and (parts is None or sig[dim][0].size % parts):
                continue
            if marks[label].mark == "spatial":
                return label
        for tensor, sig in zip(op.inputs, ann.inputs):
            if tensor in flowing or tensor not in self._inner:
                continue
            dim, pos, sizes = self._inner[tensor]
            if dim < len(sig) and tuple(f.size for f in sig[dim]) == sizes and \
                    marks[sig[dim][pos].label].mark == "spatial":
                return sig[dim][pos].label
        return None

    def _record_inputs(self, name: str, label: str, wanted: dict[str, tuple[int, int, int]]
                       ) -> None:
        """Note, for each input of ``name``, the dim and factor position (of how many) that the
        split ``label`` lies on."""
        ann = self.anns[name]
        op = self.graph.op(name)
        for tensor, sig in zip(op.inputs, ann.inputs):
            for dim, factors in enumerate(sig):
                for pos, f in enumerate(factors):
                    if f.label == label:
                        wanted.setdefault(tensor, (dim, pos, len(factors)))

    def _follow_back(self, name: str, wanted: dict[str, tuple[int, int, int]]) -> str | None:
        """The spatial label of ``name`` whose output dim a later split of the selection reads
        split, if any (the factor at the same position of a dim cut alike)."""
        ann = self.anns[name]
        if isinstance(ann, NotAnnotated):
            return None
        marks = ann.labels()
        op = self.graph.op(name)
        for tensor, sig in zip(op.outputs, ann.outputs):
            if tensor not in wanted:
                continue
            dim, pos, n = wanted[tensor]
            if dim < len(sig) and len(sig[dim]) == n and \
                    marks[sig[dim][pos].label].mark == "spatial":
                return sig[dim][pos].label
        return None

    def _label(self, name: str, dim: str, parts: int | None = None) -> str | None:
        """The label of ``name`` that a plan's ``dim`` names: a label, a flowing name or a word
        (``out``), where a factor may be written with ``_`` (``n_1``, ``height_1``: the
        grammar's names have no dots). A word whose label the tracer cut into factors (a fused
        QKV linear's ``out`` is ``(3 heads d)``) names the first factor that carries a flowing
        name and divides into ``parts``, else the first that divides, else the first."""
        ann = self.anns[name]
        if isinstance(ann, NotAnnotated):
            return None
        labels = ann.labels()
        dim = ann.words.get(dim, dim)
        dotted = dim.replace("_", ".")
        for cand in (dim, ann.label_for(dim), dotted, ann.label_for(dotted)):
            if cand and cand in labels:
                return cand
        factors = [lab for lab in labels if lab.startswith(f"{dim}.")
                   and labels[lab].mark != "frozen"]
        fits = [lab for lab in factors if parts is None or labels[lab].size % parts == 0]
        named = [lab for lab in fits if lab in ann.names]
        # of unnamed factors, one that a reader picks pieces by (the gate-or-up of a fused
        # gate_up linear that ``chunk(2)`` cuts: Phi-3) is a worse split than the one inside
        # the pieces, which the reader's parts follow without a gather
        free = [] if named or len(fits) < 2 else \
            [lab for lab in fits if not self._picks_pieces(name, lab)]
        for group in (named, free, fits, factors):
            if group:
                return group[0]
        return None

    def _picks_pieces(self, name: str, label: str) -> bool:
        """Whether a reader of an output of ``name`` has, at the factor where ``label`` lies, a
        label that cannot be split (a split's or chunk's piece index)."""
        if self._readers is None:
            self._readers = self.graph.consumers()
        op, ann = self.graph.op(name), self.anns[name]
        for tensor, sig in zip(op.outputs, ann.outputs):
            for dim, factors in enumerate(sig):
                pos = next((k for k, f in enumerate(factors) if f.label == label), None)
                if pos is None:
                    continue
                for reader in self._readers.get(tensor, ()):
                    rann = self.anns[reader.name]
                    if isinstance(rann, NotAnnotated):
                        continue
                    marks = rann.labels()
                    for t, rsig in zip(reader.inputs, rann.inputs):
                        if t == tensor and dim < len(rsig) and len(rsig[dim]) == len(factors) \
                                and marks[rsig[dim][pos].label].mark == "frozen":
                            return True
        return False

    def _missing_hint(self, names: Sequence[str], dim: str) -> str:
        """The nearest dim name the selected operators have (a misspelling), then where to
        see them all."""
        have = [w for n in names if isinstance(self.anns[n], Annotation)
                for w in _plan_dims(self.anns[n]).split(", ")]
        near = difflib.get_close_matches(dim, list(dict.fromkeys(have)), n=1, cutoff=0.6)
        see = "`ssdsl trace MODEL` shows each operator's dims"
        return f"did you mean '{near[0]}'? {see}" if near else see

    def _missing_message(self, names: Sequence[str], dim: str) -> str:
        op = self.graph.op(names[0])
        ann = self.anns[names[0]]
        if isinstance(ann, NotAnnotated):
            try:
                require(ann, op)
            except NotAnnotatedError as err:
                return err.message
        has = _plan_dims(ann) if isinstance(ann, Annotation) else "none"
        many = f" (nor do {len(names) - 1} other selected operators)" if len(names) > 1 else ""
        return (f"operator '{op.name}' ({op.kind}, in '{op.module or '<top>'}') has no dim "
                f"'{dim}'{many}; its dims: {has}")

    def _split_op(self, name: str, prefix: tuple[int, ...], label: str, n: int,
                  span: Span) -> None:
        ann = self.anns[name]
        assert isinstance(ann, Annotation)
        size = ann.sizes()[label]
        call = call_of(self.graph, self.graph.op(name))
        out: list[Part] = []
        for part in self.parts[name]:
            if part.index[:len(prefix)] != prefix:
                out.append(part)
                continue
            pieces = split_ranges(dict(part.ranges), label, size, n)
            if pieces is None:
                start, stop = dict(part.ranges).get(label, (0, size))
                raise _indivisible(self.graph.op(name), label, stop - start, n, span, ann)
            try:  # the pieces differ in ``label`` only: derived together
                subs = ann.partition_along(call, label, pieces)
            except SsdslError as err:
                raise _at(err, span) from None
            for k, (ranges, sub) in enumerate(zip(pieces, subs)):
                out.append(Part(name, part.index + (k,), part.replica + (False,),
                                tuple(sorted(ranges.items())), sub, span=span))
        self.parts[name] = out

    # ------------------------------------------------------------------ replicate
    def replicate(self, d: Replicate) -> None:
        prefix, base = part_prefix(d.selector)
        for name in select_ops(self.graph, base, d.span):
            self._replicate_op(name, prefix, d.copies, d.span)

    def _replicate_op(self, name: str, prefix: tuple[int, ...], n: int, span: Span) -> None:
        out: list[Part] = []
        for part in self.parts[name]:
            if part.index[:len(prefix)] != prefix:
                out.append(part)
                continue
            out.extend(attrs.evolve(part, index=part.index + (k,), replica=part.replica + (True,),
                                    span=span) for k in range(n))
        self.parts[name] = out

    # ------------------------------------------------------------------ assign
    def assign(self, d: Assign) -> None:
        for dev in d.devices:
            if not 0 <= dev < self.world:
                raise BadDevice(f"device {dev} is outside the {self.world} devices of this run "
                                f"(0..{self.world - 1})", d.span,
                                hint="run with more processes (--nproc) or change the plan")
        prefix, base = part_prefix(d.selector)
        self.place(select_ops(self.graph, base, d.span), prefix, d)

    def place(self, names: Sequence[str], prefix: tuple[int, ...], d: Assign) -> None:
        """Put the parts of ``names`` whose index starts with ``prefix`` on ``d.devices``."""
        placed = 0
        for name in names:
            chosen = [p for p in self.parts[name] if p.index[:len(prefix)] == prefix]
            if len(d.devices) > 1 and chosen and len(chosen) != len(d.devices):
                raise PartCountMismatch(
                    f"operator '{name}' has {len(chosen)} part{'s' if len(chosen) != 1 else ''}"
                    f", which cannot be spread one per "
                    f"device over {len(d.devices)} devices", d.span,
                    hint="partition or replicate it into as many parts as devices")
            devices = {p.index: dev for p, dev in zip(row_major(chosen), d.devices)} \
                if len(d.devices) > 1 else {p.index: d.devices[0] for p in chosen}
            _refuse_moves(name, chosen, devices, d)
            # remade by the constructor, not ``attrs.evolve``: every part of a large plan
            self.parts[name] = [Part(p.op, p.index, p.replica, p.ranges, p.sub,
                                     devices[p.index], p.span, d.span)
                                if p.index in devices else p for p in self.parts[name]]
            placed += len(chosen)
        if not placed:
            raise NoSuchParts(f"'{d.selector}' selects operators but none of their parts has "
                                 f"index {prefix}", d.span, hint="a partition or replicate into N "
                                 "makes the parts 0 to N - 1")

    # ------------------------------------------------------------------ result
    def result(self, deferred: tuple) -> Transformed:
        return Transformed(self.graph, {k: tuple(row_major(v)) for k, v in self.parts.items()},
                           self.anns, self.world, deferred, tuple(self.notes))


def _refuse_moves(name: str, chosen: Sequence[Part], devices: dict, d: Assign) -> None:
    """A part already on another device is an error at the second assign: a later assign
    silently winning would hide a plan mistake (assigning it again to the same device is fine)."""
    for p in chosen:
        if p.device is not None and p.device != devices[p.index]:
            first = f"the first assign is at {p.assigned_at}; " if p.assigned_at else ""
            raise PartReassigned(
                f"part {list(p.index)} of operator '{name}' is already on device {p.device}; "
                f"this assigns it to device {devices[p.index]}", d.span,
                hint=f"{first}assign each part once (narrow a selector with `except` or "
                     "`part i of`)")


def _indivisible(op, label: str, size: int, n: int, span: Span, ann=None) -> SsdslError:
    """The error in the user's words: the flowing name (``batch``, ``heads``) or the dim word
    of the plan (``in``, ``out``) rather than the annotation's label (``i0``, ``n.1``), and the
    module the operator comes from."""
    from ssdsl.ops import IndivisibleError
    word = _user_dim(ann, label)
    where = f"operator '{op.name}' ({op.kind}{', in ' + op.module if op.module else ''})"
    if word == "batch":
        err = IndivisibleError(
            f"the batch has {size} rows at {where}, which do not divide into {n} parts", span,
            hint=f"use a batch size that splits evenly, a multiple of {n} here (--batch-size, "
            f"or BATCH_SIZE in the model file), or a part count that divides {size}")
    else:
        inner = _inner_factors(ann, label, word)
        if word == "heads" and inner:  # grouped-query attention: kv heads, queries each
            name, per = inner[0]
            err = IndivisibleError(
                f"'heads' of {where} has size {size}, which does not divide into {n} parts: "
                f"under grouped-query attention 'heads' counts the {size} key/value heads, each "
                f"shared by '{name}' {per} query heads", span,
                hint=f"choose a number of parts that divides {size}, or split the query heads "
                f"within each group instead: `along {name}` into a number that divides {per} "
                f"(the key/value projections are then replicated)")
        else:
            err = IndivisibleError(f"'{word}' of {where} has size {size}, which does not divide "
                                   f"into {n} parts", span,
                                   hint=f"choose a number of parts that divides {size}")
    err.parts = n  # type: ignore[attr-defined]  # read by merge_same_cause
    return err


def _inner_factors(ann, label: str, word: str) -> list[tuple[str, int]]:
    """The other flowing factors of ``label``'s fused dim named after ``word`` (``heads.1``
    beside ``heads``: a query projection under grouped-query attention), as the table writes
    them (``heads_1``), with their sizes."""
    if ann is None or "." not in label:
        return []
    names = dict(getattr(ann, "names", {}) or {})
    sizes = ann.sizes() if hasattr(ann, "sizes") else {}
    base = label.rsplit(".", 1)[0]
    return [(name.replace(".", "_"), sizes[lab]) for lab, name in sorted(names.items())
            if lab != label and lab.rsplit(".", 1)[0] == base and name.startswith(word + ".")
            and lab in sizes]


def _user_dim(ann, label: str) -> str:
    if ann is None:
        return label
    names = dict(getattr(ann, "names", {}) or {})
    if label in names:
        return names[label]
    words = [w for w, lab in (getattr(ann, "words", {}) or {}).items() if lab == label]
    return words[0] if words else label.split(".")[0]


def merge_same_cause(errors: list[SsdslError]) -> list[SsdslError]:
    """Statements that fail only because their part count does not divide (``--world 3`` for
    a plan whose dims are all even): one error, at the first statement, naming the others."""
    from ssdsl.ops import IndivisibleError
    same = [e for e in errors if isinstance(e, IndivisibleError) and hasattr(e, "parts")]
    if len(same) < 2 or len({e.parts for e in same}) != 1:
        return errors
    same.sort(key=SsdslError.sort_key)
    first, rest = same[0], same[1:]
    lines = ", ".join(str(e.span.line) for e in rest if e.span is not None)
    first.hint = (f"{first.hint}; lines {lines} fail the same way, so the count of {first.parts}"
                  " (often the number of devices, --world) is the likelier thing to change")
    return [first] + [e for e in errors if e not in same]


def _leave_out_hint(d: Partition, kind: str) -> str:
    """How to keep a selection's split when one kind of operator in it cannot be split so: leave
    that kind out and replicate it. A replicated operator reads its inputs whole, so the result
    stays exact (a batch norm then takes its statistics over the whole batch, as a synchronized
    batch norm does), at the cost of gathering them."""
    sel = str(d.selector)
    if not re.fullmatch(r"[\w.\[\]*]+", sel):
        sel = f"({sel})"
    return (f"leave the {kind} operators out and replicate them (a replicated operator reads its "
            f"inputs whole, so it stays exact, at the cost of gathering them): `partition {sel} "
            f"except kind({kind}) along {d.dim} into {d.parts}`, then `replicate kind({kind}) "
            f"into {d.parts}`; or split another dimension")


def _at(err: SsdslError, span: Span) -> SsdslError:
    """``err`` located at the plan statement, when the rule that raised it had no position."""
    if err.span is None:
        err.span = span
        err.file = span.file
    return err


def apply_directives(graph: Graph, directives: Sequence, *, world: int,
                     require_placement: bool = True) -> Transformed:
    """Apply the spatial directives of a plan to ``graph``; the others are passed on.

    Independent faults are reported together; an assign by stage is left for the schedule phase.
    The graph's loss normalization is made explicit first (``normalize_losses``): the result's
    ``graph`` is that graph.
    """
    b = _Builder(normalize_losses(graph), world)
    errors = ErrorCollector()
    deferred = []
    split_failed = False
    for d in directives:
        if isinstance(d, Assign) and isinstance(part_prefix(d.selector)[1], StageRef):
            deferred.append(d)
            continue
        handler = {Partition: b.partition, Replicate: b.replicate, Assign: b.assign}.get(type(d))
        if handler is None:
            deferred.append(d)
            continue
        before = len(errors.errors)
        with errors.catch():
            handler(d)
        if isinstance(d, (Partition, Replicate)) and len(errors.errors) > before:
            split_failed = True
        elif split_failed and errors.errors[before:] and all(
                isinstance(e, NoSuchParts) for e in errors.errors[before:]):
            # the parts this assign names were to come from a partition or replicate already
            # reported: its error would only repeat that one
            del errors.errors[before:]
    errors.errors = merge_same_cause(errors.errors)
    errors.raise_if_any()
    result = b.result(tuple(deferred))
    if require_placement and not any(isinstance(d, Assign) for d in deferred):
        check_placed(result, placing_span(directives))
    return result


def assign_ops(t: Transformed, placements: Sequence[tuple[Sequence[str], Assign]]) -> Transformed:
    """``t`` with each ``(operator names, assign)`` applied, as ``assign`` applies a selector
    (the schedule phase resolves ``assign st[i] to ...`` to the operators of stage i)."""
    b = _Builder(t.graph, t.world, start=t)
    errors = ErrorCollector()
    for names, d in placements:
        with errors.catch():
            b.place(names, part_prefix(d.selector)[0], d)
    errors.raise_if_any()
    return attrs.evolve(t, parts={k: tuple(row_major(v)) for k, v in b.parts.items()})


def placing_span(directives: Sequence) -> Span | None:
    """Where a plan places its operators: its last ``assign`` (else its last statement)."""
    spans = [d.span for d in directives if isinstance(d, Assign) and d.span is not None]
    spans = spans or [d.span for d in directives if getattr(d, "span", None) is not None]
    return spans[-1] if spans else None


def check_placed(t: Transformed, at: Span | None = None) -> None:
    """Raise ``UnplacedPart`` when some part has no device: at the statement that made it, or,
    for an operator that no statement selected, at ``at`` (the plan's last placing
    statement), with the statements that would place it."""
    missing = [p for ps in t.parts.values() for p in ps if p.device is None]
    if not missing:
        return
    ops = list(dict.fromkeys(p.op for p in missing))
    made = [p for p in missing if p.index]  # parts a partition or replicate made
    if made:
        first = made[0]
        where = f" (made at {first.span})" if first.span else ""
        raise UnplacedPart(f"{len(missing)} part(s) of {len(ops)} operator(s) have no device, "
                           f"e.g. part {first.index} of '{first.op}'{where}", first.span,
                           hint="add an assign statement for them, e.g. `assign each part i to "
                           "device i`")
    op = t.graph.op(ops[0])
    module = op.module or "<top>"
    raise UnplacedPart(
        f"{len(ops)} operator(s) have no device, e.g. '{op.name}' ({op.kind}, in '{module}'): "
        "no partition or replicate statement selected them and no assign names them", at,
        origin=t.graph.origin(op.name),
        hint="add `replicate rest into N` before the assigns (a copy on each of N devices), or "
        "place them whole with `assign rest to device D`")
