"""Reductions and softmax. A summed dim is reduced (parts give partial sums); a mean is a sum
scaled by the part's share; max, softmax and friends freeze the dims they reduce over, as do the
norms (``norm``, ``linalg_vector_norm``: ``F.normalize``, ``x.norm(dim=-1)``; ``dim=None``
reduces every dim): a norm of parts is no sum of the parts' norms, and no partial-sum combine
other than a plain sum exists, so their reduced dims are frozen and the kept dims split."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ssdsl.ops.build import broadcast, dims, norm_dim, plain
from ssdsl.ops.core import (Annotation, Call, Factor, Interval, LocalCall, Unsplittable, by_extent,
                            register)


def _reduce_sigs(shape, reduced_dims, keepdim: bool):
    labels = dims(len(shape))
    ins = plain(labels, shape)
    out = []
    for k, lab in enumerate(labels):
        if k not in reduced_dims:
            out.append((Factor(lab, shape[k]),))
        elif keepdim:
            out.append((Factor(f"kept{k}", 1),))
    return ins, tuple(out), {labels[k] for k in reduced_dims}


def _reduced_dims(call: Call, shape) -> set[int]:
    d = call.arg(_dim_pos(call), "dim")
    if d is None or d == () or d == []:
        return set(range(len(shape)))
    d = [d] if isinstance(d, int) else d
    return {norm_dim(x, len(shape)) for x in d}


def _dim_pos(call: Call) -> int:
    """Position of ``dim`` (``keepdim`` follows it): after ``p`` / ``ord`` for the norms."""
    return 2 if call.op.target in ("aten.norm.ScalarOpt_dim",
                                   "aten.linalg_vector_norm.default") else 1


@by_extent
def _mean_lower(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
                kwargs: dict) -> LocalCall:
    """A part's mean covers a share of the reduced elements; scaled by it, parts sum to the
    whole mean."""
    scale = 1.0
    sizes = ann.sizes()
    for lab in ann.reduced:
        start, stop = ranges.get(lab, (0, sizes[lab]))
        scale *= (stop - start) / sizes[lab]
    return LocalCall(call.op.target, args, tuple(kwargs.items()), scale)


@register("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default",
          "aten.amax.default", "aten.amin.default", "aten.max.dim", "aten.min.dim",
          "aten.argmax.default", "aten.logsumexp.default", "aten.var.correction",
          "aten.std.correction", "aten.var.dim", "aten.std.dim", "aten.var_mean.dim",
          "aten.var_mean.correction", "aten.std_mean.dim", "aten.std_mean.correction",
          "aten.norm.ScalarOpt_dim", "aten.prod.dim_int",
          "aten.all.dim", "aten.any.dim", "aten.linalg_vector_norm.default")
def reduce(call: Call) -> Annotation:
    (shape,) = call.in_shapes[:1]
    target = call.op.target
    if target.endswith(".default") and target.split(".")[1] in ("sum", "mean"):
        red, keep = set(range(len(shape))), False
    else:
        red = _reduced_dims(call, shape)
        keep = bool(call.arg(_dim_pos(call) + 1, "keepdim", False))
    if target.split(".")[1] in ("var", "std", "var_mean", "std_mean") \
            and not target.endswith(".default"):
        # (self, dim, unbiased, keepdim) or (self, dim, *, correction, keepdim)
        keep = bool(call.op.kwargs_dict.get("keepdim", call.arg(3, "keepdim", False)))
    ins, out, labels = _reduce_sigs(shape, red, keep)
    outs = (out,) * len(call.op.outputs)
    name = target.split(".")[1]
    if name in ("sum", "mean"):
        return Annotation((ins,), outs, reduced=frozenset(labels),
                          lower=_mean_lower if name == "mean" else _keep)
    return Annotation((ins,), outs,
                      frozen={lab: f"{name} over it is not a sum of parts" for lab in labels})


@by_extent
def _keep(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    return LocalCall(call.op.target, args, tuple(kwargs.items()))


@register("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int",
          "aten._log_softmax.default", "aten.cumsum.default", "aten.cumprod.default",
          "aten.logcumsumexp.default")
def softmax(call: Call) -> Annotation:
    (shape,) = call.in_shapes
    d = norm_dim(call.arg(1, "dim"), len(shape))
    labels = dims(len(shape))
    name = call.op.kind
    how = "accumulates" if name in ("cumsum", "cumprod", "logcumsumexp") else "normalizes"
    return Annotation((plain(labels, shape),), (plain(labels, shape),),
                      frozen={labels[d]: f"{name} {how} along it"})


@register("aten.cosine_similarity.default", "aten.pairwise_distance.default")
def pairwise(call: Call) -> Annotation:
    """``F.cosine_similarity(x1, x2, dim)``, ``F.pairwise_distance(x1, x2)`` (over the last
    dim): the inputs broadcast together, the compared dim whole (a cosine normalizes over it,
    a distance is a norm of it), every other dim independent (CLIP's similarity per pair)."""
    shapes = call.in_shapes
    (out,) = call.out_shapes
    full = tuple(torch.broadcast_shapes(*shapes))
    if call.op.target == "aten.cosine_similarity.default":
        d, keep = norm_dim(call.arg(2, "dim", 1), len(full)), False
    else:
        d, keep = len(full) - 1, bool(call.arg(4, "keepdim", False))
    if not full:
        raise Unsplittable(f"{call.op.kind} of 0-dim tensors")
    ins, sig = broadcast(shapes, full)
    labels = dims(len(full))
    kept = [lab for k, lab in enumerate(labels) if k != d]
    outs = list(plain(kept, [full[k] for k in range(len(full)) if k != d]))
    if keep:
        outs.insert(d, (Factor("kept", 1),))
    if tuple(f[0].size for f in outs) != tuple(out):
        raise Unsplittable(f"{call.op.kind}: output {tuple(out)} against inputs {shapes}")
    name = call.op.kind
    return Annotation(ins, (tuple(outs),),
                      frozen={labels[d]: f"{name} compares the whole dim"})


@register("aten.diff.default")
def diff(call: Call) -> Annotation:
    """Differences along one dim: that dim is frozen (a part's first element needs its left
    neighbour); the other dims are independent."""
    shape = call.in_shapes[0]
    d = norm_dim(call.arg(2, "dim", -1), len(shape))
    labels = dims(len(shape))
    (out,) = call.out_shapes
    ins = [plain(labels, s) for s in call.in_shapes]
    out_labels = [*labels[:d], "o", *labels[d + 1:]]
    frozen = {labels[d]: "differences cross part boundaries", "o": "differences along it"}
    return Annotation(tuple(ins), (plain(out_labels, out),), frozen=frozen)


@register("aten.sort.default", "aten.sort.stable", "aten.argsort.default", "aten.argsort.stable",
          "aten.topk.default")
def sort(call: Call) -> Annotation:
    """A sort (``sort``, ``argsort``) or ``topk`` along one dim orders the whole dim: it is
    frozen; the other dims are independent (each row sorted by itself: MoE routing's
    ``topk`` over experts, a sampler's ``sort`` over the vocabulary). ``topk``'s ``k`` results
    are a dim of its own."""
    shape = call.in_shapes[0]
    target = call.op.target
    if len(shape) <= 1:
        # nothing to split: such a sort (an MoE's of every token's expert, flattened) stays
        # without an annotation, replicated where a selection reaches it, as before
        raise Unsplittable(f"{call.op.kind} of a {len(shape)}-dim tensor orders all of it")
    if target.endswith(".stable"):  # sort(self, *, stable, dim=-1, descending=False)
        d = call.arg(len(call.op.args), "dim", -1)
    else:  # sort/argsort(self, dim=-1, ...), topk(self, k, dim=-1, ...)
        d = call.arg(2 if target == "aten.topk.default" else 1, "dim", -1)
    d = norm_dim(d, len(shape)) if shape else 0
    labels = dims(len(shape))
    ins = plain(labels, shape)
    frozen = {labels[d]: f"{call.op.kind} orders the whole dim"} if shape else {}
    outs = []
    for out in call.out_shapes:
        if tuple(out) == tuple(shape):
            outs.append(plain(labels, out))
        else:  # topk's k of the dim
            outs.append(plain([*labels[:d], "k", *labels[d + 1:]], out))
            frozen["k"] = f"{call.op.kind}'s results, picked from the whole dim"
    return Annotation((ins,), tuple(outs), frozen=frozen)


@register("aten.cdist.default", "aten._cdist_forward.default")
def cdist(call: Call) -> Annotation:
    """``torch.cdist(x1, x2)``: the distance of every row of ``x1`` to every row of ``x2``
    (batch dims alike), each a norm over the features: batch and both row dims split, the
    features whole."""
    a, b = call.in_shapes
    (out,) = call.out_shapes
    if len(a) < 2 or len(a) != len(b) or tuple(a[:-2]) != tuple(b[:-2]):
        raise Unsplittable(f"{call.op.kind} of {tuple(a)} and {tuple(b)}")
    lead = dims(len(a) - 2, "b")
    return Annotation((plain([*lead, "p", "m"], a), plain([*lead, "r", "m"], b)),
                      (plain([*lead, "p", "r"], out),),
                      frozen={"m": "a distance is a norm over the features"})
