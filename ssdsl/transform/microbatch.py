"""Micro-batches: a partition in time along the batch, localized to one micro-batch.

``microbatch along batch into M`` splits every part of every operator along the batch, exactly as
``partition all along batch into M`` would (the same labels, the same value scaling of a mean:
each micro-batch's loss is its share of the batch loss, so micro-batch losses sum to the batch
loss and gradients accumulated in the weights' ``.grad`` are the batch's). The M copies run one
after another on the same devices instead of side by side.

Every micro-batch then runs the same parts on its own slice of the batch: the parts of micro-batch
k, with every region shifted to the box that micro-batch k covers in each tensor, equal those of
micro-batch 0. ``split_microbatches`` checks that and returns micro-batch 0's parts in those local
coordinates, with the local shapes and each graph input's box per micro-batch, so the later phases
plan communication once, on a graph whose batch is one micro-batch.

That check need not look at micro-batch k at all (``_by_shift``). A region is a linear function
of the label ranges (``region_of``): moving the batch label's range of a part by ``k * s`` (its
share ``s`` of the part's batch) moves every interval of a dim where the label is a factor by
``k * s * stride`` (the sizes of the factors inside it) and leaves the other dims alone. When,
for every dim of every tensor, each sub-operator touching it moves it by the same amount per
micro-batch (none for a weight, which keeps its coordinates), micro-batch k's box is
micro-batch 0's moved by that amount, so its regions in local coordinates are micro-batch 0's;
and a lowering that reads only extents (``ssdsl.ops.core.by_extent``) makes micro-batch 0's
call for each. So micro-batch 0 is derived once per distinct sub-operator and the others only
in closed form. A plan where any of that does not hold (uneven shares, a lowering that reads
where a range starts...) takes the general path, which derives every micro-batch and compares.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ssdsl.elaborate.directives import Microbatch
from ssdsl.errors import SsdslError
from ssdsl.ir.graph import writes_in_place
from ssdsl.ir.region import Region
from ssdsl.ops import Annotation, FrozenDimError, SubOp, call_of
from ssdsl.ops.core import reads_extents_only
from ssdsl.transform.apply import _Builder, _at, _indivisible
from ssdsl.transform.errors import MissingDim, TransformError
from ssdsl.transform.parts import Part, Transformed, split_ranges

Box = tuple[tuple[tuple[int, int], ...], ...]  # per dim, disjoint sorted intervals


class NotMicrobatchable(TransformError):
    """An operator reduces over the batch and its result is used by other operators (a batch
    norm's statistics): micro-batches would each see only their own share."""


class UnevenMicrobatches(TransformError):
    """Micro-batches would run different sub-operators (the batch does not split evenly)."""


class BufferUpdatedPerForward(TransformError):
    """The forward updates a buffer in place (a call counter, a batch norm's
    ``num_batches_tracked``): once a step on one device, once per micro-batch here."""


def split_microbatches(t: Transformed, d: Microbatch) -> Transformed:
    """``t`` split in time into ``d.count`` micro-batches along ``d.dim`` (see the module doc)."""
    if d.count == 1:
        return attrs.evolve(t, microbatches=1)
    fast = _by_shift(t, d)
    if fast is not None:
        local0, boxes = fast
        _refuse_buffer_updates(t, d)
        return _result(t, d, local0, boxes)
    per_mb, dtype_reads = _split(t, d)
    boxes = [_boxes(t, mb, dtype_reads) for mb in per_mb]
    local = [_localize(t, mb, bx, dtype_reads) for mb, bx in zip(per_mb, boxes)]
    for k in range(1, d.count):
        _check_same(local[0], local[k], k, d)
        if _sizes(boxes[k]) != _sizes(boxes[0]):
            raise UnevenMicrobatches(f"micro-batch {k} covers a differently shaped slice of the "
                                     "tensors than micro-batch 0", d.span)
    _refuse_buffer_updates(t, d)
    return _result(t, d, local[0], boxes)


def _refuse_buffer_updates(t: Transformed, d: Microbatch) -> None:
    """``BufferUpdatedPerForward`` where an operator writes a buffer in place: every micro-batch
    runs the forward's operators, so the update would happen ``d.count`` times a step (a
    counter would count micro-batches), against once on one device."""
    buffers = t.graph.buffers
    for op in t.graph.ops:
        if not op.inputs or op.inputs[0] not in buffers or not writes_in_place(op.target):
            continue
        name = buffers[op.inputs[0]]
        raise BufferUpdatedPerForward(
            f"'{op.name}' ({op.kind}{', in ' + op.module if op.module else ''}) updates buffer "
            f"'{name}' in place, once per forward; split into {d.count} micro-batches, the "
            f"forward runs {d.count} times a step, and the update with it", d.span,
            hint="run the plan without micro-batches (`microbatches=1`, or no `microbatch` "
            "statement), or keep the update out of the forward (in the training loop, once a "
            "step)", origin=t.graph.origin(op.name))


def _result(t: Transformed, d: Microbatch, local0: dict[str, list[Part]],
            boxes: list[dict[str, Box]]) -> Transformed:
    sizes = _sizes(boxes[0])
    shapes = {name: s for name, s in sizes.items() if s != tuple(t.graph.tensors[name].shape)}
    inputs = {name: tuple(Region(t.graph.tensors[name].shape, bx[name]) for bx in boxes)
              for name in t.graph.inputs if name in boxes[0]}
    return attrs.evolve(t, parts={op: tuple(ps) for op, ps in local0.items()},
                        microbatches=d.count, shapes=shapes, input_boxes=inputs,
                        boxes=tuple({n: bx[n] for n in shapes if n in bx} for bx in boxes))


# -- micro-batch 0 only, the others in closed form (see the module doc) ------------------------


def _by_shift(t: Transformed, d: Microbatch
              ) -> tuple[dict[str, list[Part]], list[dict[str, Box]]] | None:
    """Micro-batch 0's parts in local coordinates and every micro-batch's boxes, or None where
    the closed form does not prove that micro-batches are alike (the general path decides)."""
    b = _Builder(t.graph, t.world, start=t)
    consumed = {name for op in t.graph.ops for name in op.inputs}
    flowing: dict[str, int] = {}
    first: dict[str, list[Part]] = {}
    moves: dict[tuple[str, int], int] = {}  # (tensor, dim) -> its move per micro-batch
    found = False
    for op in t.graph.ops:
        label = b._label(op.name, d.dim) or b._follow(op.name, flowing)
        if label is not None and (len(t.parts[op.name]) > 1 and _dtype_slots(t, op.name, label)
                                  or _ignored_reads(t, op.name, flowing)):
            # a batch read for its dtype only, in parts (data parallelism replicated it): the
            # general path places it; alone, cutting it like the batch is right as it is
            return None
        if label is not None:
            found = True
            b._record(op.name, label, flowing)
        elif any(x in flowing for x in op.inputs):
            return None
        pieces = _first_pieces(t, op, label, d, any(x in consumed for x in op.outputs))
        if pieces is None:
            return None
        # a sub-operator's moves depend on its share and on which slots it touches (and their
        # ranks), not on where its regions lie: each distinct kind is noted once
        noted: set[tuple] = set()
        for part, step in pieces:
            sub = part.sub
            kind = (step, tuple(None if r is None else len(r) for r in sub.inputs),
                    tuple(None if r is None else len(r) for r in sub.outputs))
            if kind not in noted:
                noted.add(kind)
                if not _note_moves(t, op, part, label, step, moves):
                    return None
        first[op.name] = [p for p, _ in pieces]
    if not found:
        return None
    boxes0 = _boxes(t, first)
    fixed = {*t.graph.params, *t.graph.buffers, *t.graph.constants}
    if any(moves.get((name, i)) for name in boxes0 if name in fixed
           for i in range(len(boxes0[name]))):
        return None  # a weight keeps its coordinates: it cannot move with the batch
    # micro-batch k's box of a tensor: micro-batch 0's, each dim moved k times its move (a
    # tensor that does not move keeps micro-batch 0's box object)
    steps = {name: tuple(moves.get((name, i), 0) for i in range(len(box)))
             for name, box in boxes0.items()}
    boxes = [{name: box if not any(steps[name]) else
              tuple(tuple((a + k * s, z + k * s) for a, z in dim) if s else dim
                    for s, dim in zip(steps[name], box))
              for name, box in boxes0.items()} for k in range(d.count)]
    return _localize(t, first, boxes0), boxes


def _first_pieces(t: Transformed, op, label: str | None, d: Microbatch, consumed: bool
                  ) -> list[tuple[Part, int]] | None:
    """Each part of ``op`` cut to micro-batch 0, with its share of the batch (0 without a batch
    label), or None where micro-batches may differ beyond a move."""
    if label is None:  # no batch here: every micro-batch recomputes the part as it is
        return [(p, 0) for p in t.parts[op.name]]
    ann = t.annotations[op.name]
    if not isinstance(ann, Annotation):
        return None
    size = ann._sizes()[label]
    marks = ann._labels()
    same_call = reads_extents_only(ann.lower) and marks[label].mark != "reduced"
    call = call_of(t.graph, op)
    keys, r0s = [], {}  # micro-batch 0 ranges of each part; parts that differ only in replica
    for part in t.parts[op.name]:  # entries share one
        ranges = dict(part.ranges)
        start, stop = ranges.get(label, (0, size))
        if (stop - start) % d.count:
            return None
        share = (stop - start) // d.count
        r0 = {**ranges, label: (start, start + share)}
        key = tuple(sorted(r0.items()))
        keys.append((key, share))
        r0s.setdefault(key, (r0, part, ranges, start, share))
    # the subs of ranges that differ only in the batch label are derived together
    # (``partition_along``: the first in full, the others only in the dims of the label)
    rows: dict[tuple, list[tuple]] = {}
    for key, (r0, *_) in r0s.items():
        rows.setdefault(tuple(kv for kv in key if kv[0] != label), []).append(key)
    memo: dict = {}
    try:
        for row in rows.values():
            for key, sub in zip(row, ann.partition_along(call, label, [r0s[k][0] for k in row])):
                _, part, ranges, start, share = r0s[key]
                if not same_call and any(
                        ann.partition(call, {**ranges, label: (start + k * share,
                                                               start + (k + 1) * share)}).local
                        != sub.local for k in range(1, d.count)):
                    return None
                if len(sub.value) > len(part.sub.value) and consumed:
                    return None
                memo[key] = sub
    except SsdslError:
        return None
    return [(Part(part.op, part.index, part.replica, key, memo[key], part.device, part.span,
                  part.assigned_at), share)
            for part, (key, share) in zip(t.parts[op.name], keys)]


def _note_moves(t: Transformed, op, part: Part, label: str | None, share: int,
                moves: dict[tuple[str, int], int]) -> bool:
    """Record how far each dim of each tensor ``part`` touches moves per micro-batch; False
    when another sub-operator moves it differently."""
    ann = t.annotations[op.name]
    sigs = (ann.inputs, ann.outputs) if isinstance(ann, Annotation) else None
    for side, (names, regions) in enumerate(((op.inputs, part.sub.inputs),
                                             (op.outputs, part.sub.outputs))):
        for slot, (name, region) in enumerate(zip(names, regions)):
            if region is None:
                continue
            strides = _strides(sigs[side][slot], label) if sigs and label else None
            for i in range(len(region)):
                step = share * strides[i] if strides else 0
                if moves.setdefault((name, i), step) != step:
                    return False
    return True


def _strides(sig, label: str) -> tuple[int, ...]:
    """Per dim of ``sig``, the stride of ``label`` among the dim's factors (0: not there)."""
    out = []
    for dim in sig:
        stride, inner = 0, 1
        for f in reversed(dim):
            if f.label == label:
                stride = inner
            inner *= f.size
        out.append(stride)
    return tuple(out)


def _split(t: Transformed, d: Microbatch
           ) -> tuple[list[dict[str, list[Part]]], dict[str, frozenset[int]]]:
    """The parts of each micro-batch, in full coordinates; and the operators that read the
    batch for its dtype only, with those inputs' slots (``_dtype_slots``)."""
    b = _Builder(t.graph, t.world, start=t)
    consumed = {name for op in t.graph.ops for name in op.inputs}
    flowing: dict[str, int] = {}
    out: list[dict[str, list[Part]]] = [{} for _ in range(d.count)]
    dtype_reads: dict[str, frozenset[int]] = {}
    found = False
    # a value a micro-batch holds only its share of (a loss reduced over its rows), by tensor:
    # the reduction it comes from; only linear steps may follow it (``_linear_step``)
    shares: dict[str, str] = {}
    for op in t.graph.ops:
        label = b._label(op.name, d.dim) or b._follow(op.name, flowing)
        origin = next((shares[x] for x in op.inputs if x in shares), None)
        if origin is not None:
            if label is not None or not _linear_step(t, op, shares):
                raise _reduced_and_used(t, t.graph.op(origin), d)
            # ``0.5 * loss``, ``-loss``, ``ce + aux``: a micro-batch's share of the result is
            # the step applied to its shares, and the shares still add up to the whole
            shares.update((x, origin) for x in op.outputs)
            for part in t.parts[op.name]:
                for k in range(d.count):
                    out[k].setdefault(op.name, []).append(part)
            continue
        slots = _dtype_slots(t, op.name, label) if label is not None else frozenset()
        if slots:
            # ``x.new_ones(())``, ``y.type_as(x)``: any piece of ``x`` gives the same result, so
            # every micro-batch runs the part as it is and reads its own share of ``x``
            # (``_localize``); splitting the part's rows instead (the whole batch where data
            # parallelism replicated it) would give micro-batches reads at different places
            dtype_reads[op.name] = slots
            for part in t.parts[op.name]:
                for k in range(d.count):
                    out[k].setdefault(op.name, []).append(part)
            continue
        if label is not None:
            found = True
            ignored = _ignored_reads(t, op.name, flowing)
            if ignored:
                # ``mask.type_as(embeds)`` of another rank: the batch of ``embeds`` is read for
                # its dtype only while the op splits along its own batch; each micro-batch
                # reads its own share of ``embeds`` there, not the whole tensor's rows
                dtype_reads[op.name] = ignored
            b._record(op.name, label, flowing)
        elif any(x in flowing for x in op.inputs):
            raise NotMicrobatchable(
                f"operator '{op.name}' ({op.kind}, in '{op.module or '<top>'}') reads a tensor "
                f"split into micro-batches along '{d.dim}' but cannot be split itself (it would "
                "need every micro-batch at once)", d.span,
                hint="micro-batch a model whose operators all carry the batch through",
                origin=t.graph.origin(op.name))
        memo: dict = {}  # (label ranges) -> sub-operator: replicas of a part split alike
        for part in t.parts[op.name]:
            pieces = _pieces(t, b, part, label, d, memo)
            if any(len(p.sub.value) > len(part.sub.value) for p in pieces) \
                    and any(x in consumed for x in op.outputs):
                if not all(_scalar(t, x) for x in op.outputs):
                    raise _reduced_and_used(t, op, d)
                shares.update((x, op.name) for x in op.outputs)
            for k, piece in enumerate(pieces):
                out[k].setdefault(op.name, []).append(piece)
    if not found:
        raise MissingDim(f"no operator has a dim '{d.dim}' to split into micro-batches", d.span,
                         hint="`ssdsl trace MODEL` shows the flowing dims (usually 'batch')")
    return out, dtype_reads


def _reduced_and_used(t: Transformed, op, d: Microbatch) -> NotMicrobatchable:
    return NotMicrobatchable(
        f"operator '{op.name}' ({op.kind}, in '{op.module or '<top>'}') reduces over "
        f"'{d.dim}' and its result is used by later operators: each micro-batch would "
        f"see only its share", d.span,
        hint="a loss may divide by a value computed from the batch alone (a count "
        "of labelled tokens: summed over the whole batch first, docs/model_file.md), and be "
        "scaled, negated or added to other losses over the batch; a value that also depends on "
        "parameters cannot be summed over micro-batches before they run, nor can a term without "
        "the batch be added to the loss once per micro-batch: use data parallelism for it "
        "instead", origin=t.graph.origin(op.name))


def _scalar(t: Transformed, tensor: str) -> bool:
    return t.graph.tensors[tensor].numel == 1


# Steps linear in the micro-batch shares they read (every other input the same in every
# micro-batch): the shares of their result add up to the result of the whole batch
_SCALINGS = frozenset({"aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor",
                       "aten.div.Scalar", "aten.neg.default"})
_SUMS = frozenset({"aten.add.Tensor", "aten.sub.Tensor"})
_AS_IS = frozenset({"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                    "aten.squeeze.default", "aten.squeeze.dim", "aten.unsqueeze.default",
                    "aten.clone.default", "aten.alias.default", "aten._to_copy.default",
                    "aten.to.dtype", "aten.sum.default", "aten.mean.default"})


def _linear_step(t: Transformed, op, shares: Mapping[str, str]) -> bool:
    """Whether ``op`` (no batch of its own) is linear in the shares it reads: a scaling of one
    share by a value or a number the same in every micro-batch (``0.5 * loss``, ``loss / n``,
    ``-loss``), a sum or difference of shares (``ce + 0.01 * aux``; a term without the batch
    would be added once per micro-batch), or a cast or reshape of one scalar share."""
    target = str(op.target)
    ins = [x in shares for x in op.inputs]
    if not all(_scalar(t, x) for x in op.outputs):
        return False
    if target in _AS_IS or target == "aten.neg.default":
        return len(ins) == 1 and ins[0]
    if target in _SCALINGS:
        if sum(ins) != 1:
            return False
        # a quotient only of a share by a divisor, never of a divisor by a share
        return not target.startswith("aten.div") or ins[0]
    if target in _SUMS:
        return len(ins) == 2 and all(ins)
    return False


def _dtype_slots(t: Transformed, op: str, label: str) -> frozenset[int]:
    """The input slots of ``op`` in which ``label`` is read for its dtype and device only (an
    ``ignored`` label, in no output), when that is where ``label`` appears; else none."""
    ann = t.annotations[op]
    if not isinstance(ann, Annotation) or ann.labels()[label].mark != "ignored":
        return frozenset()
    return frozenset(i for i, sig in enumerate(ann.inputs)
                     if any(f.label == label for dim in sig for f in dim))


def _ignored_reads(t: Transformed, op: str, flowing: Mapping[str, int]) -> frozenset[int]:
    """The input slots of ``op`` that read a tensor split into micro-batches only for its
    dtype and device: the dim the batch flows on is an ``ignored`` label there (``x.type_as(y)``
    or ``y.new_ones(...)`` where ``y``'s rank differs from the output's)."""
    ann = t.annotations[op]
    if not isinstance(ann, Annotation) or not ann.ignored:
        return frozenset()
    names = t.graph.op(op).inputs
    return frozenset(i for i, sig in enumerate(ann.inputs)
                     if (dim := flowing.get(names[i])) is not None and dim < len(sig)
                     and sig[dim] and all(f.label in ann.ignored for f in sig[dim]))


def _pieces(t: Transformed, b: _Builder, part: Part, label: str | None, d: Microbatch,
            memo: dict) -> list[Part]:
    """``part`` split into the micro-batches; ``memo`` holds this operator's sub-operators by
    label ranges (``partition`` is a function of them: parts that differ only in replica entries
    or device get the same one)."""
    if label is None:  # no batch here (position embeddings): every micro-batch recomputes it
        return [part] * d.count
    ann = t.annotations[part.op]
    assert isinstance(ann, Annotation)
    size = ann._sizes()[label]
    ranges = split_ranges(dict(part.ranges), label, size, d.count)
    if ranges is None:
        start, stop = dict(part.ranges).get(label, (0, size))
        raise _indivisible(t.graph.op(part.op), label, stop - start, d.count, d.span, ann)
    call = memo.get("call")
    if call is None:
        call = memo["call"] = call_of(t.graph, t.graph.op(part.op))
    keys = [tuple(sorted(r.items())) for r in ranges]
    subs = memo.get(tuple(keys))
    if subs is None:
        try:
            subs = memo[tuple(keys)] = ann.partition_along(call, label, ranges)
        except FrozenDimError as err:  # a batch statistic: no micro-batch has it alone
            lookup = ann.labels()[label].reason == "looked up by index"
            hint = ("the operator reads rows by index values computed while the model runs (a "
                    "mixture of experts routing its tokens), which may point at any row of the "
                    "batch: run without micro-batches (microbatches=1), or split the batch by "
                    "data parallelism instead" if lookup else
                    "each micro-batch runs every operator on its share of the batch, and this "
                    "one needs all of it: run without micro-batches (microbatches=1), or change "
                    "the model (a GroupNorm or LayerNorm for a BatchNorm)")
            raise NotMicrobatchable(f"{err.message}: micro-batches cannot split it", d.span,
                                    hint=hint, origin=t.graph.origin(part.op)) from None
        except SsdslError as err:
            raise _at(err, d.span) from None
    return [Part(part.op, part.index, part.replica, key, sub, part.device, part.span,
                 part.assigned_at) for key, sub in zip(keys, subs)]


def _boxes(t: Transformed, parts: dict[str, list[Part]],
           dtype_reads: dict[str, frozenset[int]] | None = None) -> dict[str, Box]:
    """Per tensor and dim, the union of the intervals one micro-batch's parts touch (every
    region a part reads or writes, a sub-operator shared by several parts once), but the reads
    in ``dtype_reads``' slots.

    Local coordinates number the positions of that union in order: with dp x micro-batches,
    micro-batch 0 holds rows {0, 4} of an 8-row batch, which become local rows {0, 1}.
    """
    g = t.graph
    fixed = {*g.params, *g.buffers, *g.constants}  # weights keep their coordinates
    skip = dtype_reads or {}
    # per tensor (in order of first touch), per dim, the distinct interval tuples touched
    # (None: a weight); a region many parts touch joins once: regions are shared objects,
    # alive in ``parts`` for the whole loop, so telling them by id is cheaper than hashing them,
    # and a copy that slips through adds nothing to the union
    seen: dict[str, list[set] | None] = {}
    done: set = set()

    def touch(name, ivs):
        if (name, id(ivs)) in done:
            return
        done.add((name, id(ivs)))
        if name in seen:
            dims = seen[name]
        else:
            dims = seen[name] = None if name in fixed else [set() for _ in ivs]
        if dims is not None:
            for into, d in zip(dims, ivs):
                into.add(d)

    for op in g.ops:
        subs: set[int] = set()  # ids of subs alive in ``parts`` for the whole loop
        skipped = skip.get(op.name, frozenset())
        for p in parts[op.name]:
            sub = p.sub
            if id(sub) in subs:
                continue
            subs.add(id(sub))
            for slot, (name, ivs) in enumerate(zip(op.inputs, sub.inputs)):
                if ivs is not None and slot not in skipped:
                    touch(name, ivs)
            for name, ivs in zip(op.outputs, sub.outputs):
                touch(name, ivs)
    if skip:  # a tensor read for its dtype alone, and by nothing else: the read as it is
        touched = set(seen)
        for op, slots in skip.items():
            names = g.op(op).inputs
            for p in parts[op]:
                for slot, ivs in enumerate(p.sub.inputs):
                    if slot in slots and ivs is not None and names[slot] not in touched:
                        touch(names[slot], ivs)
    return {name: tuple(((0, s),) for s in g.tensors[name].shape) if dims is None
            else tuple(_merge([iv for d in dim for iv in d]) for dim in dims)
            for name, dims in seen.items()}


def _merge(intervals: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _to_local(ivs, union) -> tuple[tuple[int, int], ...]:
    """``ivs`` (inside ``union``) renumbered by position within ``union``."""
    if len(union) == 1:  # one block (the usual box): a plain shift
        lo, hi = union[0]
        if all(lo <= a and b <= hi for a, b in ivs):
            return tuple((a - lo, b - lo) for a, b in ivs)
    out = []
    for a, b in ivs:
        offset = 0
        for lo, hi in union:
            if lo <= a and b <= hi:
                out.append((offset + a - lo, offset + b - lo))
                break
            offset += hi - lo
    return tuple(out)


def _localize(t: Transformed, parts: dict[str, list[Part]], boxes: dict[str, Box],
              dtype_reads: dict[str, frozenset[int]] | None = None) -> dict[str, list[Part]]:
    """Each part's regions shifted to the micro-batch's box (local coordinates); an input read
    for its dtype only (``dtype_reads``) reads the whole box: the micro-batch's own share."""
    dtype_reads = dtype_reads or {}
    out = {}
    shifted: dict = {}  # (tensor, region) -> local region: many parts read the same region
    per_dim: dict = {}  # (id(union), intervals) -> local intervals: fewer still differ per dim
    by_sub: dict = {}   # id(sub) -> (sub, local sub): parts that share a sub-operator

    def dim(ivs, union):
        key = (id(union), ivs)  # every union is held by ``boxes`` for the whole loop
        found = per_dim.get(key)
        if found is None:
            found = per_dim[key] = _to_local(ivs, union)
        return found

    def shift(name, ivs):
        key = (name, ivs)
        found = shifted.get(key)
        if found is None:
            found = shifted[key] = tuple(map(dim, ivs, boxes[name]))
        return found

    for op in t.graph.ops:
        local = []
        for p in parts[op.name]:
            sub = p.sub
            done = by_sub.get(id(sub))
            if done is None or done[0] is not sub:
                whole = dtype_reads.get(op.name, frozenset())
                ins = tuple(None if ivs is None else
                            tuple(((0, sum(b - a for a, b in d)),) for d in boxes[n])
                            if slot in whole else shift(n, ivs)
                            for slot, (n, ivs) in enumerate(zip(op.inputs, sub.inputs)))
                outs = tuple(shift(n, ivs) for n, ivs in zip(op.outputs, sub.outputs))
                done = by_sub[id(sub)] = (sub, SubOp(ins, outs, sub.value, sub.local))
            local.append(Part(p.op, p.index, p.replica, p.ranges, done[1], p.device, p.span,
                              p.assigned_at))
        out[op.name] = local
    return out


def _check_same(first: dict[str, list[Part]], other: dict[str, list[Part]], k: int,
                d: Microbatch) -> None:
    for op, ps in first.items():
        for a, b in zip(ps, other[op]):
            if a.device != b.device or not _same_sub(a.sub, b.sub):
                raise UnevenMicrobatches(
                    f"micro-batch {k} of operator '{op}' is not micro-batch 0's moved along "
                    f"'{d.dim}' (part {a.index}): the batch does not split into {d.count} "
                    "equal micro-batches here, or the operator reads the batch through a tensor "
                    "that is not split with it (rows picked or merged by an operator that "
                    "cannot be split along it)", d.span,
                    hint="choose a micro-batch count that divides the batch of every part; "
                    f"`ssdsl trace MODEL` shows which operators carry '{d.dim}' through and "
                    "which cannot be split along it")


def _same_sub(a: SubOp, b: SubOp) -> bool:
    """``_same_shape(a) == _same_shape(b)``, without building either."""
    return a is b or (a.inputs == b.inputs and a.outputs == b.outputs and a.local == b.local
                      and len(a.value) == len(b.value)
                      and all(la == lb and x1 - x0 == y1 - y0 for (la, (x0, x1)), (lb, (y0, y1))
                              in zip(a.value, b.value)))


def _same_shape(sub):
    """A sub-operator without where its value split lies (micro-batch k holds the k-th share)."""
    return attrs.evolve(sub, value=tuple((label, b - a) for label, (a, b) in sub.value))


def _sizes(boxes: dict[str, Box]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(sum(b - a for a, b in d) for d in box) for name, box in boxes.items()}
