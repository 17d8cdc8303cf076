"""The annotation data model: factors, annotations, sub-operators, and the registry.

See the package docstring (``ssdsl/ops/__init__.py``) for the API as the transform uses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from ssdsl.ir.graph import Op, TensorInfo, TensorRef, map_tensor_refs
from ssdsl.ops.errors import FrozenDimError, IndivisibleError, NotAnnotatedError, UnknownDimError


@attrs.frozen
class Factor:
    """One factor of a tensor dim in an annotation: a label local to the op and its size."""

    label: str
    size: int

    def __repr__(self) -> str:
        return f"{self.label}:{self.size}"


Dim = tuple[Factor, ...]          # the factors of one tensor dim, outermost first
Sig = tuple[Dim, ...]             # one tensor: a Dim per tensor dim
Interval = tuple[int, int]        # half-open index range [start, stop)
Region = tuple[tuple[Interval, ...], ...]  # per tensor dim, the intervals it covers


@attrs.frozen
class Slot:
    """In a lowered call, the ``index``-th tensor input of the op (``Op.inputs[index]``)."""

    index: int

    def __repr__(self) -> str:
        return f"#{self.index}"


@attrs.frozen
class LocalCall:
    """How a sub-operator runs on local sub-tensors: ``target(*args, **kwargs) * scale``.

    ``args``/``kwargs`` hold ``Slot``s where the op's tensor inputs go; an input whose slot is
    absent is not needed by this part (a bias kept only in part 0 of a value split).
    """

    target: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    scale: float = 1.0

    def slots(self) -> set[int]:
        found: set[int] = set()
        _walk_slots((self.args, tuple(v for _, v in self.kwargs)), found)
        return found

    def bind(self, tensors: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Concrete ``(args, kwargs)`` with slot ``i`` replaced by ``tensors[i]``."""
        sub = lambda v: _map_slots(v, tensors)  # noqa: E731
        return sub(self.args), {k: sub(v) for k, v in self.kwargs}


def _walk_slots(value: Any, found: set[int]) -> None:
    if isinstance(value, Slot):
        found.add(value.index)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk_slots(v, found)


def _map_slots(value: Any, tensors: Sequence[Any]) -> Any:
    if isinstance(value, Slot):
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        return type(value)(_map_slots(v, tensors) for v in value)
    return value


@attrs.frozen
class Call:
    """What an annotation rule and a lowering rule see: the op, with shapes of its tensors."""

    op: Op
    tensors: Mapping[str, TensorInfo]

    def arg(self, index: int, name: str | None = None, default: Any = None) -> Any:
        """Argument by position, else by keyword ``name``, else ``default``."""
        if index < len(self.op.args):
            return self.op.args[index]
        return self.op.kwargs_dict.get(name, default) if name else default

    def info(self, ref: TensorRef) -> TensorInfo:
        return self.tensors[ref.name]

    def shape(self, index: int, name: str | None = None) -> tuple[int, ...]:
        """Shape of the tensor argument at ``index`` (or keyword ``name``)."""
        return self.info(self.arg(index, name)).shape

    @property
    def in_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.tensors[t].shape for t in self.op.inputs)

    @property
    def out_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.tensors[t].shape for t in self.op.outputs)


# (call, annotation, label ranges of this part, slotted args, slotted kwargs) -> LocalCall
LowerFn = Callable[["Call", "Annotation", Mapping[str, Interval], tuple, dict], LocalCall]


def by_extent(fn: LowerFn) -> LowerFn:
    """Mark ``fn`` as a lowering that reads of its ranges only each label's extent (stop -
    start) and whether a reduced label starts at 0 (``first_value_part``). Moving the range of
    a label that is not reduced then leaves its call unchanged: every micro-batch of a part
    makes micro-batch 0's call (``ssdsl.transform.microbatch`` relies on it instead of lowering
    each micro-batch). Unmarked lowerings (``arange``'s reads the start) are lowered for each."""
    fn.by_extent = True  # type: ignore[attr-defined]
    return fn


def reads_extents_only(fn: LowerFn) -> bool:
    """Whether ``fn`` was marked with ``by_extent``."""
    return getattr(fn, "by_extent", False)


@by_extent
def keep_args(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
              kwargs: dict) -> LocalCall:
    """The default lowering: the same target and arguments on the local tensors."""
    return LocalCall(call.op.target, args, tuple(kwargs.items()))


@attrs.frozen
class Label:
    """What the annotation says about one label: its size and mark, and why when frozen."""

    name: str
    size: int
    mark: str  # "spatial" | "reduced" | "frozen" | "ignored"
    reason: str | None = None


@attrs.frozen
class Annotation:
    """An einsum-like signature of one op call.

    ``inputs[i]`` describes ``op.inputs[i]``; ``outputs[j]`` describes ``op.outputs[j]``. A label
    found in an output is *spatial* (each part computes a slice of the outputs) when it also occurs
    in an input or is in ``generated`` (the op makes that dim itself, e.g. ``arange``, an
    ``expand``ed dim); a label only in inputs is *reduced* when listed in ``reduced`` (parts give
    partial sums); a label in ``ignored`` is an input dim the op reads nothing of but dtype and
    device (``x.new_ones(size)``): a part may read any piece of it and makes the same output;
    every other label, and every label in ``frozen``, cannot be split.
    ``names`` gives the flowing name an op introduces for a label (attention's heads);
    ``words`` gives plain words a plan may use for a label (a linear's ``out`` and ``in``).
    """

    inputs: tuple[Sig, ...]
    outputs: tuple[Sig, ...]
    reduced: frozenset[str] = frozenset()
    generated: frozenset[str] = frozenset()
    frozen: Mapping[str, str] = attrs.field(converter=MappingProxyType, factory=dict)
    ignored: frozenset[str] = frozenset()
    names: Mapping[str, str] = attrs.field(converter=MappingProxyType, factory=dict)
    words: Mapping[str, str] = attrs.field(converter=MappingProxyType, factory=dict)
    # labels of which each output element reads only a few (a convolution's or a pooling's
    # input positions, the window sliding over them; an embedding's vocabulary, one row a
    # token): they are no dim of the op's iteration space (``op_cost``)
    windows: frozenset[str] = frozenset()
    lower: LowerFn = attrs.field(default=keep_args, eq=False)
    # sizes() and labels(), derived once: the transform asks for them once per part (a value of
    # a frozen annotation, so never stale; not a field that compares or prints)
    _memo: dict = attrs.field(init=False, factory=dict, eq=False, repr=False)

    def sizes(self) -> dict[str, int]:
        """Every label's size (the same at every occurrence)."""
        return dict(self._sizes())

    def _sizes(self) -> dict[str, int]:
        found = self._memo.get("sizes")
        if found is None:
            found = {}
            for sig in (*self.inputs, *self.outputs):
                for dim in sig:
                    for f in dim:
                        found[f.label] = f.size
            self._memo["sizes"] = found
        return found

    def labels(self) -> dict[str, Label]:
        """Every label with its mark, in order of first occurrence."""
        return dict(self._labels())

    def _labels(self) -> dict[str, Label]:
        found = self._memo.get("labels")
        if found is None:
            in_out = {f.label for sig in self.outputs for d in sig for f in d}
            in_in = {f.label for sig in self.inputs for d in sig for f in d}
            found = {name: _mark(self, name, size, name in in_out, name in in_in)
                     for name, size in self._sizes().items()}
            self._memo["labels"] = found
        return found

    def label_for(self, name: str) -> str | None:
        """The label that carries flowing name ``name`` (see ``ssdsl.ops.annotate``), or None.
        Where an ``ignored`` input dim (read for its dtype and device only) carries the name too
        (``x.new_ones(idx.shape)`` with ``x`` of another rank), the op's own dim names it: a
        split along the ignored one would make every part compute the whole output."""
        found = None
        for label, flowing in self.names.items():
            if flowing == name:
                if label not in self.ignored:
                    return label
                found = found or label
        return found

    def splittable(self) -> list[str]:
        """Labels that may be split: spatial and reduced ones."""
        return [n for n, lab in self.labels().items() if lab.mark in ("spatial", "reduced")]

    def refined(self, label: str, sizes: Sequence[int]) -> Annotation:
        """The same annotation with ``label`` cut into factors ``label.0, label.1, ...`` of
        ``sizes`` (outermost first). Always valid: an op treats each index of a label alike."""
        if len(sizes) <= 1:
            return self
        parts = tuple(Factor(f"{label}.{i}", s) for i, s in enumerate(sizes))
        cut = lambda sig: tuple(  # noqa: E731
            tuple(p for f in dim for p in (parts if f.label == label else (f,))) for dim in sig)
        names = {k: v for k, v in self.names.items() if k != label}
        expand = lambda labels: frozenset(  # noqa: E731
            p.label for lab in labels for p in (parts if lab == label else (Factor(lab, 0),)))
        frozen = dict(self.frozen)
        if label in frozen:
            frozen.update({p.label: frozen[label] for p in parts})
        return attrs.evolve(self, inputs=tuple(map(cut, self.inputs)),
                            outputs=tuple(map(cut, self.outputs)),
                            reduced=expand(self.reduced), generated=expand(self.generated),
                            ignored=expand(self.ignored), frozen=frozen, names=names)

    def partition(self, call: Call, ranges: Mapping[str, Interval]) -> SubOp:
        """The sub-operator that covers ``ranges`` (label -> index interval) of its labels."""
        labels = self._labels()
        for name, (start, stop) in ranges.items():
            _check_range(call, labels, name, start, stop)
        slotted, kwargs = _slotted_once(call.op)
        local = self.lower(call, self, ranges, slotted, kwargs)
        needed = local.slots()
        value = tuple((n, r) for n, r in ranges.items()
                      if labels[n].mark == "reduced" and r != (0, labels[n].size))
        return SubOp(
            inputs=tuple(self._region(sig, ranges) if i in needed else None
                         for i, sig in enumerate(self.inputs)),
            outputs=tuple(self._region(sig, ranges) for sig in self.outputs),
            value=value, local=local)

    def partition_along(self, call: Call, label: str, ranges: Sequence[Mapping[str, Interval]]
                        ) -> list[SubOp]:
        """``[self.partition(call, r) for r in ranges]`` where the ``ranges`` differ only in
        ``label``'s interval (a part cut into micro-batches): the first is derived in full, the
        others reuse every region dim without ``label`` and recompute only the dims with it."""
        if not ranges:
            return []
        first = self.partition(call, ranges[0])
        out = [first]
        labels = self._labels()
        slotted, kwargs = _slotted_once(call.op)
        needed_first = first.local.slots()
        # a lowering that reads only extents makes the first's call wherever the label's
        # extent is the first's and the label is not reduced (``by_extent``); the value split
        # (reduced labels only) is then the first's as well
        lab = labels.get(label)
        extent = None
        if reads_extents_only(self.lower) and lab is not None and lab.mark != "reduced":
            a0, z0 = ranges[0].get(label, (0, lab.size))
            extent = z0 - a0
        for r in ranges[1:]:
            if label in r:  # the other labels passed for the first already
                start, stop = r[label]
                _check_range(call, labels, label, start, stop)
            else:
                start, stop = 0, lab.size if lab is not None else 0
            if extent is not None and stop - start == extent:
                local, needed, value = first.local, needed_first, first.value
            else:
                local = self.lower(call, self, r, slotted, dict(kwargs))
                needed = needed_first if local == first.local else local.slots()
                value = tuple((n, x) for n, x in r.items()
                              if labels[n].mark == "reduced" and x != (0, labels[n].size))
            ins = tuple(self._region_along(sig, label, r, had) if i in needed else None
                        for i, (sig, had) in enumerate(zip(self.inputs, first.inputs)))
            outs = tuple(self._region_along(sig, label, r, had)
                         for sig, had in zip(self.outputs, first.outputs))
            out.append(SubOp(inputs=ins, outputs=outs, value=value, local=local))
        return out

    def _region_along(self, sig: Sig, label: str, ranges: Mapping[str, Interval],
                      had: Region | None) -> Region:
        """``region_of(sig, ranges)`` given ``had``, the region for ranges that differ only in
        ``label`` (None: not known)."""
        if had is None:
            return self._region(sig, ranges)
        kinds = self._memo.get(("along", id(sig), label))
        if kinds is None or kinds[0] is not sig:
            # the dims of the label alone, and the dims where it is among other factors; the
            # other dims do not change
            kinds = (sig, tuple(i for i, dim in enumerate(sig)
                                if len(dim) == 1 and dim[0].label == label),
                     tuple(i for i, dim in enumerate(sig)
                           if len(dim) > 1 and any(f.label == label for f in dim)))
            self._memo[("along", id(sig), label)] = kinds
        _, alone, among = kinds
        if not alone and not among:
            return had
        out = list(had)
        for i in alone:
            start, stop = ranges.get(label, (0, sig[i][0].size))
            out[i] = ((start, stop),)
        for i in among:
            out[i] = dim_intervals(sig[i], ranges)
        return tuple(out)

    def _region(self, sig: Sig, ranges: Mapping[str, Interval]) -> Region:
        """``region_of(sig, ranges)``, remembered by the ranges of ``sig``'s own labels: the parts
        of an op mostly differ in a few labels, and a tensor without them keeps its region."""
        regions = self._memo.get("regions")
        if regions is None:
            regions = self._memo["regions"] = {}
        labels = regions.get(id(sig))
        if labels is None or labels[0] is not sig:  # the sig is held by self: ids stay unique
            labels = regions[id(sig)] = (sig, tuple(f.label for dim in sig for f in dim))
        try:
            key = (id(sig), *map(ranges.get, labels[1]))
            found = regions.get(key)
        except TypeError:  # unhashable ranges (a list): not remembered
            return region_of(sig, ranges)
        if found is None:
            found = regions[key] = region_of(sig, ranges)
        return found

    def split(self, call: Call, label: str, parts: int, index: int) -> SubOp:
        """Part ``index`` of ``parts`` equal parts of ``label`` (see ``partition``)."""
        size = self.sizes().get(label)
        if size is None:
            raise UnknownDimError(f"operator '{call.op.name}' ({call.op.kind}) has no dimension "
                                  f"'{label}'", hint=f"its dimensions: {', '.join(self.sizes())}")
        if parts < 1 or size % parts:
            raise IndivisibleError(f"dimension '{label}' of operator '{call.op.name}' has size "
                                   f"{size}, which does not divide into {parts} parts",
                                   hint="choose a number of parts that divides the size")
        step = size // parts
        return self.partition(call, {label: (index * step, (index + 1) * step)})


def _mark(ann: Annotation, name: str, size: int, in_out: bool, in_in: bool) -> Label:
    if name in ann.ignored and not in_out:
        return Label(name, size, "ignored", "read for its dtype and device only")
    if name in ann.frozen:
        return Label(name, size, "frozen", ann.frozen[name])
    if size == 1:
        return Label(name, size, "frozen", "size 1")
    if in_out and (in_in or name in ann.generated):
        return Label(name, size, "spatial")
    if in_out:
        return Label(name, size, "frozen", "made by the operator, which cannot make a part of it")
    if name in ann.reduced:
        return Label(name, size, "reduced")
    return Label(name, size, "frozen", "not in the output, and not a sum over it")


def _check_range(call: Call, labels: Mapping[str, Label], name: str, start: int,
                 stop: int) -> None:
    op = call.op
    if name not in labels:
        raise UnknownDimError(f"operator '{op.name}' ({op.kind}) has no dimension '{name}'",
                              hint=f"its dimensions: {', '.join(labels)}")
    lab = labels[name]
    if (start, stop) == (0, lab.size):
        return
    if lab.mark == "frozen":
        where = f"; the operator is in '{op.module}'" if op.module else ""
        raise FrozenDimError(f"dimension '{name}' of operator '{op.name}' ({op.kind}) cannot be "
                             f"split: {lab.reason}{where}", hint="split another dimension, or "
                             "replicate this operator")
    if not 0 <= start < stop <= lab.size:
        raise IndivisibleError(f"range [{start}, {stop}) is outside dimension '{name}' of "
                               f"operator '{op.name}' (size {lab.size})")


_last_slotted: tuple[Any, tuple, dict] = (None, (), {})


def _slotted_once(op: Op) -> tuple[tuple, dict]:
    """``_slotted(op)``, reused while the same op is partitioned again (its parts come in a row).
    A fresh kwargs dict each time: a lowering rule may change it."""
    global _last_slotted
    last, args, kwargs = _last_slotted
    if last is not op:
        args, kwargs = _slotted(op)
        _last_slotted = (op, args, kwargs)
    return args, dict(kwargs)


def _slotted(op: Op) -> tuple[tuple, dict]:
    counter = iter(range(len(op.inputs)))
    to_slot = lambda ref: Slot(next(counter))  # noqa: E731
    args = map_tensor_refs(op.args, to_slot)
    kwargs = {k: map_tensor_refs(v, to_slot) for k, v in op.kwargs}
    return args, kwargs


def region_of(sig: Sig, ranges: Mapping[str, Interval]) -> Region:
    """The region of a tensor with signature ``sig`` when its labels cover ``ranges``.

    A dim of factors ``(a b c)`` covering ``b`` in ``[s, e)`` is strided: one interval per index of
    ``a``. Example: ``region_of(((Factor("t", 3), Factor("h", 4)),), {"h": (0, 2)})`` is
    ``(((0, 2), (4, 6), (8, 10)),)``.
    """
    return tuple(dim_intervals(dim, ranges) for dim in sig)


def dim_intervals(dim: Dim, ranges: Mapping[str, Interval]) -> tuple[Interval, ...]:
    """The index intervals of one dim (see ``region_of``)."""
    if len(dim) == 1:  # the common case: one factor, one interval
        start, stop = ranges.get(dim[0].label, (0, dim[0].size))
        return ((start, stop),)
    intervals: list[Interval] = [(0, 1)]
    inner = 1
    for f in reversed(dim):
        start, stop = ranges.get(f.label, (0, f.size))
        if intervals == [(0, inner)]:
            intervals = [(start * inner, stop * inner)]
        else:
            intervals = [(j * inner + a, j * inner + b) for j in range(start, stop)
                         for a, b in intervals]
        inner *= f.size
    return tuple(intervals)


def local_size(dim: Dim, ranges: Mapping[str, Interval]) -> int:
    """Size of ``dim`` in a part that covers ``ranges``."""
    return math.prod(_extent(f, ranges) for f in dim)


def local_shape(sig: Sig, ranges: Mapping[str, Interval]) -> list[int]:
    """Shape of a tensor of signature ``sig`` in a part that covers ``ranges``."""
    return [local_size(d, ranges) for d in sig]


def _extent(f: Factor, ranges: Mapping[str, Interval]) -> int:
    start, stop = ranges.get(f.label, (0, f.size))
    return stop - start


@attrs.frozen
class SubOp:
    """One part of a partitioned op.

    ``inputs[i]`` is the region of ``op.inputs[i]`` this part reads (``None``: not read);
    ``outputs[j]`` the region of ``op.outputs[j]`` it writes. ``value`` lists the reduced labels it
    covers a part of, as ``(label, (start, stop))``: when not empty, each output is a partial sum
    (the parts over the reduced labels add up to the full output). ``local`` runs it.
    """

    inputs: tuple[Region | None, ...]
    outputs: tuple[Region, ...]
    value: tuple[tuple[str, Interval], ...]
    local: LocalCall


@attrs.frozen
class NotAnnotated:
    """An op without a usable annotation: it can be replicated, not partitioned."""

    reason: str


Rule = Callable[[Call], Annotation]
_RULES: dict[str, Rule] = {}
_REPLICATE_ONLY: dict[str, str] = {}


class Unsplittable(Exception):
    """Raised by a rule for a call it cannot annotate (the message says why)."""


def register(*targets: str) -> Callable[[Rule], Rule]:
    """Decorator: ``rule`` annotates calls of every ATen overload in ``targets``.

    Example::

        @register("aten.relu.default", "aten.gelu.default")
        def unary(call: Call) -> Annotation: ...
    """
    def deco(rule: Rule) -> Rule:
        for t in targets:
            if t in _RULES:
                raise ValueError(f"two annotations for {t}")
            _RULES[t] = rule
        return rule
    return deco


def replicate_only(reason: str, *targets: str) -> None:
    """Mark ``targets`` as known ops that can only be replicated, with the reason shown to users."""
    for t in targets:
        _REPLICATE_ONLY[t] = reason


def registered() -> dict[str, Rule]:
    """Every annotated overload and its rule."""
    return dict(_RULES)


def replicate_only_ops() -> dict[str, str]:
    """Every overload marked replicate-only, with its reason."""
    return dict(_REPLICATE_ONLY)


def annotate_call(call: Call) -> Annotation | NotAnnotated:
    """The annotation of one call, or why there is none."""
    target = call.op.target
    if target in _REPLICATE_ONLY:
        return NotAnnotated(_REPLICATE_ONLY[target])
    rule = _RULES.get(target)
    if rule is None:
        return NotAnnotated(f"no annotation for {target}")
    try:
        return rule(call)
    except Unsplittable as exc:
        return NotAnnotated(str(exc))
    except Exception as exc:  # noqa: BLE001 - a rule that did not foresee these shapes
        # an ssdsl gap, not the user's fault: the operator is replicated like one without a
        # rule, and a plan that partitions it is refused at its line, with this reason
        return NotAnnotated(f"ssdsl's rule for {target} does not cover inputs of shapes "
                            f"{', '.join(str(tuple(s)) for s in call.in_shapes) or 'none'} "
                            f"({type(exc).__name__}: {exc}; please report it)")


def require(ann: Annotation | NotAnnotated, op: Op) -> Annotation:
    """``ann`` when it is an annotation; else the error a partition request must raise."""
    if isinstance(ann, NotAnnotated):
        raise NotAnnotatedError(f"operator '{op.name}' ({op.kind}, in module "
                                f"'{op.module or '<top>'}') cannot be partitioned: {ann.reason}",
                                hint="replicate it instead")
    return ann
