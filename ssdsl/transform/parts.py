"""Parts: the sub-operators that partition and replicate make, and where assign puts them.

Every operator starts as one part with index ``()``. ``partition X along D into N`` replaces each
part of each selected operator by N parts, appending ``0..N-1`` to the part index and narrowing
the range of D's label; ``replicate X into N`` appends ``0..N-1`` without narrowing anything (the
entry is marked as a replica, which matters for gradients: replicas compute the same values, so
their gradients are copies, while parts that read the same input region along a split of another
dim contribute partial gradients that must be summed). ``assign`` sets each part's device.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from itertools import compress
from types import MappingProxyType
from typing import Any

import attrs

from ssdsl.ir.graph import Graph, Op, map_tensor_refs
from ssdsl.ir.region import Region
from ssdsl.ops import Annotation, LocalCall, NotAnnotated, Slot, SubOp

Interval = tuple[int, int]
Regions = tuple[tuple[Interval, ...], ...]


@attrs.frozen
class Part:
    """One sub-operator: which slice of its operator it computes, and on which device.

    ``index`` has one entry per partition/replicate applied to the operator, in plan order;
    ``replica[i]`` tells whether entry i came from ``replicate``. ``ranges`` are the annotation
    label ranges this part covers (empty: the whole operator). ``sub`` gives the regions of the
    operator's inputs and outputs this part reads and writes, and the local ATen call.
    """

    op: str
    index: tuple[int, ...]
    replica: tuple[bool, ...]
    ranges: tuple[tuple[str, Interval], ...]
    sub: SubOp
    device: int | None = None
    span: Any = None          # Span of the last partition/replicate that shaped this part
    assigned_at: Any = None   # Span of the assign that placed it

    @property
    def partition_index(self) -> tuple[int, ...]:
        """The index entries that came from partition (replica entries dropped)."""
        return tuple(compress(self.index, map(operator.not_, self.replica)))

    @property
    def replica_index(self) -> tuple[int, ...]:
        """The index entries that came from replicate."""
        return tuple(compress(self.index, self.replica))

    def value_part(self, sizes: Mapping[str, int]) -> tuple[int, int]:
        """``(k, V)``: the outputs hold the k-th of V partial sums (``(0, 1)``: full values)."""
        k, v = 0, 1
        for label, (start, stop) in self.sub.value:
            n = sizes[label] // (stop - start)
            k, v = k * n + start // (stop - start), v * n
        return k, v


@attrs.frozen
class Transformed:
    """A graph with its operators split into parts, each placed on a device.

    ``parts[op]`` lists the parts of each operator in row-major order of their index;
    ``deferred`` holds the directives for the later phases (microbatch, stages, order, ...).
    """

    graph: Graph
    parts: Mapping[str, tuple[Part, ...]] = attrs.field(converter=MappingProxyType)
    annotations: Mapping[str, Annotation | NotAnnotated] = attrs.field(
        converter=MappingProxyType, eq=False)
    world: int
    deferred: tuple[Any, ...] = ()
    notes: tuple[str, ...] = ()
    # Pipelines (set by ``ssdsl.schedule.resolve``): the stage of every operator (empty: one
    # stage), and the micro-batch count. With micro-batches, ``parts`` are the parts of ONE
    # micro-batch in micro-batch-local coordinates: ``shapes`` overrides the logical shape of
    # every tensor the batch split narrows, and ``input_boxes[name][k]`` is the region of graph
    # input ``name`` that micro-batch k reads (every micro-batch runs the same parts on it).
    stage_of: Mapping[str, int] = attrs.field(converter=MappingProxyType, factory=dict)
    microbatches: int = 1
    shapes: Mapping[str, tuple[int, ...]] = attrs.field(converter=MappingProxyType, factory=dict)
    input_boxes: Mapping[str, tuple[Any, ...]] = attrs.field(converter=MappingProxyType,
                                                             factory=dict)
    # ``boxes[k][name]``: per dim, the intervals of tensor ``name`` (global coordinates) that
    # micro-batch k covers, for every tensor the batch split narrows (verification maps a
    # micro-batch's values back onto the whole batch's with it)
    boxes: tuple[Mapping[str, Any], ...] = ()
    # The operators ``recompute`` statements select, each with the statement's span (set by
    # ``ssdsl.schedule.resolve``, which resolves stages and refuses a selection of nothing).
    recompute: Mapping[str, Any] = attrs.field(converter=MappingProxyType, factory=dict)
    # tables derived from ``parts`` once (``grad_value_part``); a changed copy starts empty
    _memo: dict = attrs.field(init=False, factory=dict, eq=False, repr=False)

    def shape(self, tensor: str) -> tuple[int, ...]:
        """The logical shape of ``tensor`` as the parts see it (one micro-batch's, if split)."""
        found = self.shapes.get(tensor)
        return found if found is not None else tuple(self.graph.tensors[tensor].shape)

    def region(self, tensor: str, intervals, part: tuple[int, int] = (0, 1)) -> Region:
        """The ``Region`` of ``tensor`` (its shape as the parts see it) with ``intervals`` and
        value part ``part``; made once per plan (the producers, consumers and gradients of
        every edge name the same few regions again: a weight's under data parallelism)."""
        key = ("region", tensor, tuple(intervals), part)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = Region(self.shape(tensor), key[2], part=part)
        return found

    def stage(self, op: str) -> int:
        """The pipeline stage of operator ``op`` (0 without stages)."""
        return self.stage_of.get(op, 0)

    @property
    def num_stages(self) -> int:
        return max(self.stage_of.values(), default=0) + 1

    def label_sizes(self, op: str) -> dict[str, int]:
        ann = self.annotations[op]
        return ann.sizes() if isinstance(ann, Annotation) else {}

    def devices(self) -> list[int]:
        """The devices that hold at least one part."""
        return sorted({p.device for ps in self.parts.values() for p in ps if p.device is not None})

    def parts_on(self, device: int) -> list[Part]:
        """The parts placed on ``device``, in graph order."""
        return [p for op in self.graph.ops for p in self.parts[op.name] if p.device == device]

    def grad_value_part(self, part: Part, input_index: int) -> tuple[int, int]:
        """``(k, V)`` of the gradient ``part`` computes for its ``input_index``-th input.

        Parts of one operator that read the same region of an input and differ in a partition
        entry (not only in replica entries) each compute a partial gradient of that region: the
        column-parallel linear's input, a data-parallel weight. Replicas compute copies.
        """
        # one table per (operator, input) makes this linear in the operator's parts: every
        # reader of an input asks it (64 parts of every op of GPT-3 under dp 8 x tp 8)
        table = self._memo.get(("grad", part.op, input_index))
        if table is None:
            groups: dict[tuple, set[tuple[int, ...]]] = {}
            for p in self.parts[part.op]:
                groups.setdefault((p.sub.inputs[input_index], p.replica_index), set()).add(
                    p.partition_index)
            table = self._memo[("grad", part.op, input_index)] = {
                key: sorted(found) for key, found in groups.items()}
        siblings = table[(part.sub.inputs[input_index], part.replica_index)]
        return siblings.index(part.partition_index), len(siblings)


def whole_part(graph: Graph, op: Op, ann: Annotation | NotAnnotated) -> SubOp:
    """The single part of an unsplit operator: full regions, the original call."""
    if isinstance(ann, Annotation):
        call = _call(graph, op)
        return ann.partition(call, {})
    counter = iter(range(len(op.inputs)))
    to_slot = lambda ref: Slot(next(counter))  # noqa: E731
    args = map_tensor_refs(op.args, to_slot)
    kwargs = tuple((k, map_tensor_refs(v, to_slot)) for k, v in op.kwargs)
    full = lambda name: tuple(((0, s),) for s in graph.tensors[name].shape)  # noqa: E731
    return SubOp(inputs=tuple(full(t) for t in op.inputs),
                 outputs=tuple(full(t) for t in op.outputs), value=(),
                 local=LocalCall(op.target, args, kwargs))


def _call(graph: Graph, op: Op):
    from ssdsl.ops import call_of
    return call_of(graph, op)


def split_ranges(ranges: Mapping[str, Interval], label: str, size: int, parts: int
                 ) -> list[dict[str, Interval]] | None:
    """The label ranges of ``parts`` equal parts of ``label``'s current range (None: indivisible)."""
    start, stop = ranges.get(label, (0, size))
    if (stop - start) % parts:
        return None
    step = (stop - start) // parts
    return [{**ranges, label: (start + k * step, start + (k + 1) * step)} for k in range(parts)]


def row_major(parts: list[Part]) -> list[Part]:
    return sorted(parts, key=lambda p: p.index)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
