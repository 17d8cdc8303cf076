"""View and shape operators: they move, merge and split dims without arithmetic.

Merges and splits are factorizations (``reshape_sigs``): the ``C`` of ``view(B, T, C) -> (B, T, h,
d)`` is the merged dim ``(h d)``, so a split of ``h`` survives the view and the transposes after it,
and a split of ``h`` in a fused ``(3 h d)`` dim is a strided region.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ssdsl.ops.build import broadcast, dims, lower_sizes, norm_dim, plain, reshape_sigs, set_arg
from ssdsl.ops.core import (
    Annotation, Call, Factor, Interval, LocalCall, Unsplittable, by_extent, local_shape,
    register,
)


@register("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
def view(call: Call) -> Annotation:
    (src,), (dst,) = call.in_shapes, call.out_shapes
    i, o, frozen = reshape_sigs(src, dst)
    return Annotation((i,), (o,), frozen=frozen, lower=lower_sizes(1, "size"))


@register("aten.view_as.default", "aten.reshape_as.default", "aten.expand_as.default")
def view_as(call: Call) -> Annotation:
    """``x.view_as(y)``: a view to ``y``'s shape, which is all it reads of ``y``; a part reshapes
    its piece of ``x`` to its local shape and does not need ``y`` (``expand_as`` likewise)."""
    (src, _), (dst,) = call.in_shapes, call.out_shapes
    if call.op.target == "aten.expand_as.default":
        ann = expand_sigs(src, dst)
        ins, out, frozen, made = ann
        target = "aten.expand.default"
    else:
        ins, out, frozen = reshape_sigs(src, dst)
        made, target = frozenset(), "aten.reshape.default"

    @by_extent
    def lower(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
        return LocalCall(target, (args[0], tuple(local_shape(ann.outputs[0], ranges))))
    return Annotation((ins, out), (out,), frozen=frozen, generated=made, lower=lower)


@register("aten.flatten.using_ints")
def flatten(call: Call) -> Annotation:
    (src,), (dst,) = call.in_shapes, call.out_shapes
    i, o, frozen = reshape_sigs(src, dst)
    return Annotation((i,), (o,), frozen=frozen)


@register("aten.unflatten.int")
def unflatten(call: Call) -> Annotation:
    (src,), (dst,) = call.in_shapes, call.out_shapes
    i, o, frozen = reshape_sigs(src, dst)
    d = norm_dim(call.arg(1, "dim"), len(src))
    n = len(dst) - len(src) + 1
    pick = lambda call, sizes: sizes[d:d + n]  # noqa: E731
    return Annotation((i,), (o,), frozen=frozen, lower=lower_sizes(2, "sizes", transform=pick))


@register("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
          "aten.squeeze.default")
def unsqueeze(call: Call) -> Annotation:
    (src,), (dst,) = call.in_shapes, call.out_shapes
    i, o, frozen = reshape_sigs(src, dst)
    return Annotation((i,), (o,), frozen=frozen, lower=_lower_squeeze)


@by_extent
def _lower_squeeze(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    # A bare squeeze() would also drop a dim that a part made size 1: name the dims it drops.
    if call.op.target != "aten.squeeze.default":
        return LocalCall(call.op.target, args, tuple(kwargs.items()))
    (src,) = call.in_shapes
    return LocalCall("aten.squeeze.dims", (args[0], tuple(k for k, s in enumerate(src) if s == 1)))


@register("aten.permute.default")
def permute(call: Call) -> Annotation:
    (src,) = call.in_shapes
    labels = dims(len(src))
    order = [norm_dim(p, len(src)) for p in call.arg(1, "dims")]
    return Annotation((plain(labels, src),),
                      (plain([labels[p] for p in order], [src[p] for p in order]),))


@register("aten.numpy_T.default")
def numpy_t(call: Call) -> Annotation:
    """``x.T``: every dim reversed (a transpose for a matrix: Falcon's ``x @ weight.T``)."""
    (src,) = call.in_shapes
    labels = dims(len(src))
    return Annotation((plain(labels, src),), (plain(labels[::-1], src[::-1]),))


@register("aten.transpose.int", "aten.t.default", "aten.mT.default", "aten.adjoint.default",
          "aten.matrix_H.default")
def transpose(call: Call) -> Annotation:
    """``transpose(x, a, b)``; ``x.t()`` (a matrix, or a vector unchanged); ``x.mT``,
    ``x.adjoint()`` and ``x.H`` swap the last two dims (the latter two conjugate too: an
    elementwise map, so any split passes through them)."""
    (src,) = call.in_shapes
    labels = dims(len(src))
    if call.op.target == "aten.t.default":
        a, b = 0, len(src) - 1
    elif call.op.target != "aten.transpose.int":
        a, b = len(src) - 2, len(src) - 1
    else:
        a, b = (norm_dim(call.arg(k, n), len(src)) for k, n in ((1, "dim0"), (2, "dim1")))
    out = list(labels)
    if len(src) > 1:
        out[a], out[b] = labels[b], labels[a]
    return Annotation((plain(labels, src),), (plain(out, [src[labels.index(x)] for x in out]),))


def _piece_sigs(shape, d: int, pieces: int, piece: int, *, whole_in: bool):
    """Signatures for cutting dim ``d`` of ``shape`` into ``pieces`` equal pieces of ``piece``:
    the whole dim is ``(s c)``; each piece is ``(c)``. ``s`` (which piece) cannot be split."""
    labels = dims(len(shape))
    whole = list(plain(labels, shape))
    whole[d] = (Factor("s", pieces), Factor("c", piece))
    part = list(plain(labels, shape))
    part[d] = (Factor("c", piece),)
    return tuple(whole), tuple(part)


@register("aten.split.Tensor", "aten.chunk.default", "aten.split_with_sizes.default",
          "aten.unsafe_split.Tensor")
def split(call: Call) -> Annotation:
    (src,), outs = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(2, "dim", 0), len(src))
    return _pieces(call, src, outs, d, cat=False)


@register("aten.cat.default")
def cat(call: Call) -> Annotation:
    ins, (dst,) = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dim", 0), len(dst))
    return _pieces(call, dst, ins, d, cat=True)


def _pieces(call: Call, whole_shape, piece_shapes, d: int, *, cat: bool) -> Annotation:
    sizes = {s[d] for s in piece_shapes}
    frozen = {"s": "selects which piece"}
    if len(sizes) == 1 and all(len(s) == len(whole_shape) for s in piece_shapes):
        whole, part = _piece_sigs(whole_shape, d, len(piece_shapes), sizes.pop(), whole_in=True)
        parts = (part,) * len(piece_shapes)
        lower = _lower_split if not cat else None
    else:  # uneven pieces: dim d is frozen in all tensors
        labels = dims(len(whole_shape))
        whole = plain(labels, whole_shape)
        parts = tuple(plain([*labels[:d], f"p{k}", *labels[d + 1:]], s)
                      for k, s in enumerate(piece_shapes))
        why = (f"cut into uneven pieces ({', '.join(str(s[d]) for s in piece_shapes)}: a "
               "dim cut into pieces of different sizes, as a fused multi-query projection is "
               "cut into query and key/value, is kept whole)")
        frozen.update({labels[d]: why} | {f"p{k}": why for k in range(len(parts))})
        lower = None
    extra = {"lower": lower} if lower else {}
    if cat:
        return Annotation(parts, (whole,), frozen=frozen, **extra)
    return Annotation((whole,), parts, frozen=frozen, **extra)


@by_extent
def _lower_split(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
                 kwargs: dict) -> LocalCall:
    target = call.op.target
    if target in ("aten.split.Tensor", "aten.unsafe_split.Tensor"):
        args, kw = set_arg(args, kwargs, 1, "split_size", local_shape(ann.outputs[0], ranges)
                           [_split_dim(call)])
        return LocalCall(target, args, kw)
    if target == "aten.split_with_sizes.default":
        local = [local_shape(o, ranges)[_split_dim(call)] for o in ann.outputs]
        args, kw = set_arg(args, kwargs, 1, "split_sizes", tuple(local))
        return LocalCall(target, args, kw)
    return LocalCall(target, args, tuple(kwargs.items()))  # chunk: the count stays


def _split_dim(call: Call) -> int:
    return norm_dim(call.arg(2, "dim", 0), len(call.in_shapes[0]))


@register("aten.stack.default")
def stack(call: Call) -> Annotation:
    ins, (dst,) = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dim", 0), len(dst))
    labels = dims(len(ins[0]))
    out_labels = [*labels[:d], "s", *labels[d:]]
    return Annotation(tuple(plain(labels, s) for s in ins), (plain(out_labels, dst),),
                      frozen={"s": "selects which piece"})


@register("aten.unbind.int")
def unbind(call: Call) -> Annotation:
    (src,), outs = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dim", 0), len(src))
    labels = dims(len(src))
    labels[d] = "s"
    rest = [x for x in labels if x != "s"]
    return Annotation((plain(labels, src),), tuple(plain(rest, o) for o in outs),
                      frozen={"s": "selects which piece"})


@register("aten.select.int")
def select(call: Call) -> Annotation:
    (src,), (dst,) = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dim"), len(src))
    labels = dims(len(src))
    labels[d] = "i"
    return Annotation((plain(labels, src),), (plain([x for x in labels if x != "i"], dst),),
                      frozen={"i": "an index is picked from it"})


@register("aten.slice.Tensor")
def slice_(call: Call) -> Annotation:
    """``x[a:b:step]`` along one dim. The full dim passes through; ``x[r::step]`` with ``r <
    step`` dividing the dim is ``(q step) -> (q)``, so the ``q`` of a patch merge can be split."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dim", 0), len(src))
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1) or 1
    start = norm_dim(start or 0, src[d])
    end = src[d] if end is None or end >= src[d] else norm_dim(end, src[d])
    labels = dims(len(src))
    ins, outs = list(plain(labels, src)), list(plain(labels, dst))
    frozen = {}
    if (start, end, step) == (0, src[d], 1):
        pass
    elif start < step and end == src[d] and src[d] % step == 0:
        ins[d] = (Factor("q", src[d] // step), Factor("r", step))
        outs[d] = (Factor("q", dst[d]),)
        frozen["r"] = "a stride of the slice"
    else:
        ins[d], outs[d] = (Factor("a", src[d]),), (Factor("b", dst[d]),)
        why = (f"sliced ([{start}:{end}] of {src[d]}: a slice of part of a dim keeps it whole, "
               "as when a fused projection is sliced into query, key and value of different "
               "sizes)")
        frozen.update(a=why, b=why)
    return Annotation((tuple(ins),), (tuple(outs),), frozen=frozen, lower=_lower_slice)


@by_extent
def _lower_slice(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    # Only a full or a strided-to-the-end slice can be split along its own dim; the end must then
    # follow the local size, which "to the end" (None) does. A partial slice keeps its bounds
    # (its dim is frozen, so whole in every part).
    (src,) = call.in_shapes
    d = norm_dim(call.arg(1, "dim", 0), len(src))
    end = call.arg(3, "end")
    if end is None or end >= src[d]:
        args, kw = set_arg(args, kwargs, 3, "end", None)
        return LocalCall(call.op.target, args, kw)
    return LocalCall(call.op.target, args, tuple(kwargs.items()))


def expand_sigs(src, dst):
    """Signatures of expanding ``src`` to ``dst``: (input, output, frozen, generated labels)."""
    labels = dims(len(dst))
    offset = len(dst) - len(src)
    ins = tuple((Factor(labels[offset + j] if s == dst[offset + j] else f"one{j}", s),)
                for j, s in enumerate(src))
    made = frozenset(labels[k] for k in range(len(dst))
                     if k < offset or src[k - offset] != dst[k])
    return ins, plain(labels, dst), {}, made


@register("aten.expand.default")
def expand(call: Call) -> Annotation:
    (src,), (dst,) = call.in_shapes[:1], call.out_shapes
    ins, out, _, made = expand_sigs(src, dst)
    return Annotation((ins,), (out,), generated=made, lower=lower_sizes(1, "size"))


@register("aten.repeat.default")
def repeat(call: Call) -> Annotation:
    """``x.repeat(r0, r1, ...)``: output dim k is the input's dim tiled ``r_k`` times, the merged
    dim ``(r_k n_k)`` with the copy outermost (``out[c * n + j] = x[j]``); leading counts past
    ``x``'s rank make new dims ``(r_k)``. The copies are generated (a part makes as many as its
    piece holds) and the input's dims flow through, so the batch of an ALiBi bias built as
    ``slopes.repeat(batch, 1, 1)`` can be split."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    reps = tuple(call.arg(1, "repeats"))
    offset = len(reps) - len(src)
    ins, outs, made = [], [], set()
    for k, r in enumerate(reps):
        copies = (Factor(f"c{k}", r),) if r > 1 or k < offset else ()
        made.update(f.label for f in copies)
        if k < offset:
            outs.append(copies)
            continue
        n = src[k - offset]
        inner = Factor(f"d{k}" if n > 1 or not copies else f"one{k}", n)
        ins.append((inner,))
        outs.append((*copies, inner) if n > 1 or not copies else copies)
    assert tuple(math.prod(f.size for f in d) for d in outs) == tuple(dst)

    @by_extent
    def lower(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
        # the tracer may have cut a count into factors (``c0.0, c0.1``): their extents multiply
        local = tuple(math.prod(_extent_of(f, ranges) for f in d if f.label.startswith("c"))
                      for d in ann.outputs[0])
        return LocalCall(call.op.target, *set_arg(args, kwargs, 1, "repeats", local))
    return Annotation((tuple(ins),), (tuple(outs),), generated=frozenset(made), lower=lower)


def _extent_of(f: Factor, ranges: Mapping[str, Interval]) -> int:
    start, stop = ranges.get(f.label, (0, f.size))
    return stop - start


@register("aten.repeat_interleave.self_int")
def repeat_interleave(call: Call) -> Annotation:
    """``x.repeat_interleave(r, dim)``: each index of ``dim`` repeated ``r`` times in place, the
    merged dim ``(n r)`` with the copy innermost (``out[j * r + c] = x[j]``; GPT-J's rotary
    tables). The copies are generated, every dim of ``x`` flows through. Without ``dim`` the
    input is flattened first: not annotated."""
    (src,), (_dst,) = call.in_shapes, call.out_shapes
    dim, r = call.arg(2, "dim"), call.arg(1, "repeats")
    if dim is None or not isinstance(r, int):
        raise Unsplittable("repeat_interleave over the flattened input")
    d = norm_dim(dim, len(src))
    labels = dims(len(src))
    ins = plain(labels, src)
    outs = list(ins)
    outs[d] = (Factor(labels[d], src[d]), Factor("c", r)) if src[d] > 1 else (Factor("c", r),)
    if src[d] == 1:
        ins = tuple((Factor("one", 1),) if k == d else f for k, f in enumerate(ins))

    @by_extent
    def lower(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
        copies = math.prod(_extent_of(f, ranges) for f in ann.outputs[0][d]
                           if f.label.startswith("c"))
        args, kw = set_arg(args, kwargs, 1, "repeats", copies)
        kw = tuple((k, local_shape(ann.outputs[0], ranges)[d] if k == "output_size" else v)
                   for k, v in kw)
        if len(args) > 3:
            args = args[:3] + (local_shape(ann.outputs[0], ranges)[d],) + args[4:]
        return LocalCall(call.op.target, args, kw)
    return Annotation((ins,), (tuple(outs),), generated=frozenset({"c"}), lower=lower)


@register("aten.roll.default")
def roll(call: Call) -> Annotation:
    (src,) = call.in_shapes
    labels = dims(len(src))
    rolled = call.arg(2, "dims", ())
    rolled = [rolled] if isinstance(rolled, int) else list(rolled)
    if not rolled:
        return Annotation((plain(labels, src),), (plain(labels, src),),
                          frozen={lab: "rolled (flattened)" for lab in labels})
    frozen = {labels[norm_dim(r, len(src))]: "rolled: every part needs the wrap-around"
              for r in rolled}
    return Annotation((plain(labels, src),), (plain(labels, src),), frozen=frozen)


@register("aten.index.Tensor")
def index(call: Call) -> Annotation:
    """``x[i0, i1, ...]``: the indexed dims of x are looked up (frozen); the index tensors'
    broadcast dims and x's other dims can be split. The broadcast dims stand where the indexed
    dims were when those are adjacent, else first (numpy's rule)."""
    src, dst = call.shape(0, "self"), call.out_shapes[0]
    indices = call.arg(1, "indices")
    used = [k for k, t in enumerate(indices) if t is not None]
    idx_shapes = [call.info(indices[k]).shape for k in used]
    bshape = dst[used[0]:used[0] + len(dst) - (len(src) - len(used))] \
        if used == list(range(used[0], used[-1] + 1)) else dst[:len(dst) - len(src) + len(used)]
    idx_sigs, bsig = broadcast(idx_shapes, bshape, "i")
    labels = dims(len(src))
    frozen = {}
    for k in used:
        labels[k] = f"v{k}"
        frozen[f"v{k}"] = "looked up by index"
    rest = [(Factor(lab, s),) for lab, s in zip(labels, src) if not lab.startswith("v")]
    if used == list(range(used[0], used[-1] + 1)):
        before = [(Factor(lab, s),) for lab, s in zip(labels[:used[0]], src[:used[0]])]
        out = (*before, *bsig, *rest[len(before):])
    else:
        out = (*bsig, *rest)
    frozen.update({f.label: "an index dim broadcast from size 1"
                   for sig in idx_sigs for d in sig for f in d if "_b" in f.label})
    return Annotation((plain(labels, src), *idx_sigs), (tuple(out),), frozen=frozen)


@register("aten.gather.default")
def gather(call: Call) -> Annotation:
    """``x.gather(d, idx)``: ``out[.., i, ..] = x[.., idx[.., i, ..], ..]`` along ``d``. Dim ``d`` of
    ``x`` is looked up (frozen); ``idx`` and the output share every dim. Another dim of ``x``
    shares the label when ``idx`` has its size (a part reads the same rows of both); a smaller
    one (``idx`` reads its first entries) is frozen in all three."""
    src = call.shape(0, "self")
    d = norm_dim(call.arg(1, "dim"), len(src))
    idx = call.shape(2, "index")
    labels = dims(len(idx))
    x_labels = [f"v{k}" if k == d or s != idx[k] else labels[k] for k, s in enumerate(src)]
    frozen = {f"v{d}": "looked up by index"}
    for k, s in enumerate(src):
        if k != d and s != idx[k]:
            frozen.update({f"v{k}": "the index reads only its first entries",
                           labels[k]: "the index reads only the first entries of the input"})
    return Annotation((plain(x_labels, src), plain(labels, idx)), (plain(labels, idx),),
                      frozen=frozen)


@register("aten.scatter_add.default")
@register("aten.scatter.src")
@register("aten.scatter_reduce.two")
def scatter(call: Call) -> Annotation:
    """``x.scatter_add(d, idx, src)`` (``scatter``, ``scatter_reduce``): ``out[.., idx[.., i, ..],
    ..] (+)= src[.., i, ..]`` along ``d``. Dim ``d`` is written by index in ``x`` and read in
    order in ``idx`` and ``src`` (all frozen: a part of ``idx`` may write anywhere in ``d``);
    every other dim is shared by ``x``, ``idx``, ``src`` and the output when they have its
    size (a part writes only its own rows), else frozen in all of them (``idx`` covers only
    the first entries)."""
    src = call.shape(0, "self")
    d = norm_dim(call.arg(1, "dim"), len(src))
    idx = call.shape(2, "index")
    val = call.shape(3, "src")
    labels = dims(len(src))
    x_labels = [f"v{k}" if k == d else labels[k] for k in range(len(src))]
    i_labels = [f"w{k}" if k == d else labels[k] for k in range(len(idx))]
    s_labels = [f"u{k}" if k == d else labels[k] for k in range(len(val))]
    why = "scattered into by index"
    frozen = {f"v{d}": why, f"w{d}": why, f"u{d}": why}
    for k in range(len(src)):
        if k != d and not (src[k] == idx[k] == val[k]):
            x_labels[k], i_labels[k], s_labels[k] = f"v{k}", f"w{k}", f"u{k}"
            frozen.update({f"v{k}": "the index covers only its first entries",
                           f"w{k}": "the index covers only the first entries of the input",
                           f"u{k}": "the index covers only the first entries of the input"})
    return Annotation((plain(x_labels, src), plain(i_labels, idx), plain(s_labels, val)),
                      (plain(x_labels, src),), frozen=frozen)


@register("aten.flip.default")
def flip(call: Call) -> Annotation:
    """``x.flip(dims)``: the flipped dims whole (a part's output comes from the mirrored part of
    the input), the others pass through."""
    (src,) = call.in_shapes
    labels = dims(len(src))
    flipped = {norm_dim(d, len(src)) for d in call.arg(1, "dims")}
    return Annotation((plain(labels, src),), (plain(labels, src),),
                      frozen={labels[d]: "flipped: a part's output is the mirrored part's input"
                              for d in flipped})


@register("aten.movedim.int")
def movedim(call: Call) -> Annotation:
    """``x.movedim(source, destination)``: a permutation of the dims."""
    (src,) = call.in_shapes
    n = len(src)
    labels = dims(n)
    a, b = norm_dim(call.arg(1, "source"), n), norm_dim(call.arg(2, "destination"), n)
    order = [k for k in range(n) if k != a]
    order.insert(b, a)
    return Annotation((plain(labels, src),),
                      (plain([labels[k] for k in order], [src[k] for k in order]),))


@register("aten.narrow.default")
def narrow(call: Call) -> Annotation:
    """``x.narrow(dim, start, length)``: the narrowed dim whole (as a slice of part of a dim),
    the others pass through; narrowing nothing away passes everything."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dim"), len(src))
    labels = dims(len(src))
    if tuple(src) == tuple(dst):  # a part narrows its own extent: all of it
        return Annotation((plain(labels, src),), (plain(labels, dst),), lower=_lower_full_narrow)
    out_labels = [*labels[:d], "b", *labels[d + 1:]]
    why = f"narrowed ({dst[d]} of {src[d]}): a part of a dim keeps it whole"
    return Annotation((plain(labels, src),), (plain(out_labels, dst),),
                      frozen={labels[d]: why, "b": why})


@by_extent
def _lower_full_narrow(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
                       kwargs: dict) -> LocalCall:
    (src,) = call.in_shapes
    d = norm_dim(call.arg(1, "dim"), len(src))
    size = math.prod(stop - start for start, stop in
                     (ranges.get(f.label, (0, f.size)) for f in ann.inputs[0][d]))
    args, items = set_arg(args, kwargs, 2, "start", 0)
    args, items = set_arg(args, dict(items), 3, "length", size)
    return LocalCall(call.op.target, args, items)


@register("aten.unfold.default")
def unfold(call: Call) -> Annotation:
    """``x.unfold(dim, size, step)``: windows of one dim (its window count in its place, each
    window's positions last), that dim whole; the other dims pass through."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    d = norm_dim(call.arg(1, "dimension"), len(src)) if src else 0
    labels = dims(len(src))
    if not src:
        raise Unsplittable("unfold of a 0-dim tensor")
    out_labels = [*labels[:d], "w", *labels[d + 1:], "s"]
    why = "windows overlap or span neighbouring positions"
    return Annotation((plain(labels, src),), (plain(out_labels, dst),),
                      frozen={labels[d]: why, "w": why, "s": why}, windows=frozenset({labels[d]}))


@register("aten.outer.default")
def outer(call: Call) -> Annotation:
    """``torch.outer(a, b)``: every product, both dims independent (a rotary table's
    ``outer(positions, frequencies)``)."""
    (n,), (m,) = call.in_shapes
    return Annotation((plain(["i"], (n,)), plain(["j"], (m,))), (plain(["i", "j"], (n, m)),))


@register("aten.one_hot.default")
def one_hot(call: Call) -> Annotation:
    """``F.one_hot(labels, classes)``: each label's row of its own; the classes are made whole
    by every part."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    labels = dims(len(src))
    return Annotation((plain(labels, src),), (plain([*labels, "k"], dst),),
                      frozen={"k": "one-hot classes: each part makes them all"})


@register("aten.index_select.default")
def index_select(call: Call) -> Annotation:
    """``x.index_select(dim, index)``: the indexed dim of ``x`` read whole (rows picked by
    value); the index's positions, and every other dim, split (each part picks its own)."""
    src, idx = call.in_shapes
    (dst,) = call.out_shapes
    d = norm_dim(call.arg(1, "dim"), len(src)) if src else 0
    labels = dims(len(src))
    if not src or len(idx) != 1:
        raise Unsplittable("index_select of a 0-dim tensor")
    x_labels = [*labels[:d], "a", *labels[d + 1:]]
    out_labels = [*labels[:d], "i", *labels[d + 1:]]
    return Annotation((plain(x_labels, src), plain(["i"], idx)), (plain(out_labels, dst),),
                      frozen={"a": "rows picked by value: any part may need any row"},
                      windows=frozenset({"a"}))


@register("aten.pixel_shuffle.default", "aten.pixel_unshuffle.default")
def pixel_shuffle(call: Call) -> Annotation:
    """``F.pixel_shuffle(x, r)`` and its inverse: channels and positions exchanged; the leading
    (batch) dims pass through, channels and positions whole."""
    (src,), (dst,) = call.in_shapes, call.out_shapes
    if len(src) < 3:
        raise Unsplittable(f"{call.op.kind} of a {len(src)}-dim tensor")
    lead = dims(len(src) - 3)
    why = "channels and positions are exchanged across it"
    return Annotation((plain(lead + ["c", "h", "w"], src),),
                      (plain(lead + ["C", "H", "W"], dst),),
                      frozen={lab: why for lab in ("c", "h", "w", "C", "H", "W")})
