"""Losses. The batch (and any extra target dims) of a sum-reduced loss is reduced: parts give
partial sums. A mean whose divisor is a size (``mse_loss``, cross-entropy against class
probabilities) is a sum scaled by each part's share of the elements. The class dim is frozen (the
softmax inside cross-entropy).

A cross-entropy or NLL mean over integer targets divides by the count of targets that are not
``ignore_index`` (or by their total class weight): that divisor depends on the data, so no part
knows it, and scaling by a share would be wrong whenever the parts hold different counts. Its
batch dims are frozen here; the transform rewrites such a loss as its per-target terms divided
by the whole batch's count, summed (``ssdsl.transform.normalize``), which splits like any sum."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ssdsl.ops.build import broadcast, dims, plain
from ssdsl.ops.core import (Annotation, Call, Factor, Interval, LocalCall, Unsplittable, by_extent,
                            register)

_MEAN, _SUM = 1, 2


def _share(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
           kwargs: dict, reduction: int) -> LocalCall:
    scale = 1.0
    if reduction == _MEAN:
        sizes = ann.sizes()
        for lab in ann.reduced:
            start, stop = ranges.get(lab, (0, sizes[lab]))
            scale *= (stop - start) / sizes[lab]
    return LocalCall(call.op.target, args, tuple(kwargs.items()), scale)


@register("aten.cross_entropy_loss.default", "aten.nll_loss.default",
          "aten.nll_loss_nd.default")
def cross_entropy(call: Call) -> Annotation:
    x, t = call.shape(0, "self"), call.shape(1, "target")
    reduction = call.arg(3, "reduction", _MEAN)
    probabilities = len(t) == len(x)  # class probabilities: a target per class
    if len(x) == 1:  # unbatched: (C,) against ()
        x_sig, rest = ((Factor("C", x[0]),),), []
        t_sig = x_sig if probabilities else ()
    else:
        rest = dims(len(x) - 2, "s")
        x_sig = ((Factor("N", x[0]),), (Factor("C", x[1]),), *plain(rest, x[2:]))
        t_sig = x_sig if probabilities else ((Factor("N", x[0]),), *plain(rest, t[1:]))
    ins = [x_sig, t_sig]
    if call.arg(2, "weight") is not None:
        ins.append(((Factor("C", x[-1] if len(x) == 1 else x[1]),),))
    batch = {"N", *rest} if len(x) > 1 else set()
    frozen = {"C": "the softmax of cross-entropy normalizes over the classes"}
    if reduction == 0:
        out = t_sig if not probabilities else (x_sig[:1] + x_sig[2:] if len(x) > 1 else ())
        return Annotation(tuple(ins), (out,), frozen=frozen)
    if reduction == _MEAN and not probabilities:
        frozen.update({b: "the mean divides by the count of targets not ignored, which only the "
                       "whole batch knows (the transform rewrites it as a sum)" for b in batch})
    lower = by_extent(lambda c, a, r, args, kw: _share(c, a, r, args, kw, reduction))
    return Annotation(tuple(ins), ((),), reduced=frozenset(batch), frozen=frozen, lower=lower)


# A loss of one term per element (the inputs broadcast together), summed or averaged over all of
# them: target -> the position of its ``reduction`` argument.
_POINTWISE = {
    "aten.mse_loss.default": 2, "aten.l1_loss.default": 2, "aten.smooth_l1_loss.default": 2,
    "aten.huber_loss.default": 2, "aten.soft_margin_loss.default": 2,
    "aten.kl_div.default": 2,  # F.kl_div's "batchmean" is its sum divided by the batch after it
    "aten.binary_cross_entropy.default": 3, "aten.hinge_embedding_loss.default": 3,
    "aten.margin_ranking_loss.default": 4,
    "aten.binary_cross_entropy_with_logits.default": 4,
    "aten.poisson_nll_loss.default": 5,
}


@register(*_POINTWISE)
def pointwise_loss(call: Call) -> Annotation:
    # every tensor argument (input, target, a weight: ``pos_weight`` of (C,) against (N, C))
    # broadcast to their common shape, each read at its own shape, a dim broadcast from 1 whole
    # by every part
    x = tuple(torch.broadcast_shapes(*call.in_shapes))
    labels = dims(len(x))
    ins, sig = broadcast(call.in_shapes, x)
    reduction = call.arg(_POINTWISE[call.op.target], "reduction", _MEAN)
    if reduction == 0:
        return Annotation(ins, (sig,))
    lower = by_extent(lambda c, a, r, args, kw: _share(c, a, r, args, kw, reduction))
    return Annotation(ins, ((),), reduced=frozenset(labels), lower=lower)


# A loss of one term per sample that reads each sample's features (or classes) together:
# target -> (the tensor arguments that hold samples x features, the position of ``reduction``,
# why the features stay whole). The mean is over the samples.
_PER_SAMPLE = {
    "aten.cosine_embedding_loss.default": (2, 4, "the cosine of a pair normalizes over its "
                                                 "features"),
    "aten.triplet_margin_loss.default": (3, 7, "a triplet's distances are norms over its "
                                               "features"),
    "aten.multi_margin_loss.default": (1, 5, "each sample's margins compare all its classes "
                                             "with its target's"),
    "aten.multilabel_margin_loss.default": (2, 2, "each sample's margins compare its target "
                                                  "classes with all the others"),
}


@register(*_PER_SAMPLE)
def per_sample_loss(call: Call) -> Annotation:
    n_features, at, why = _PER_SAMPLE[call.op.target]
    shapes = call.in_shapes
    first = shapes[0]
    if len(first) not in (1, 2) or any(tuple(s) != tuple(first) for s in shapes[1:n_features]):
        raise Unsplittable(f"{call.op.target} of inputs {[tuple(s) for s in shapes]}: expected "
                           "(samples, features) or (features,) alike")
    batched = len(first) == 2
    feat = ((Factor("C", first[-1]),),)
    row = ((Factor("N", first[0]),),) if batched else ()
    ins: list = [row + feat] * n_features
    for s in shapes[n_features:]:  # a target per sample, or a class weight after it
        if tuple(s) == (first[-1],) and call.op.target == "aten.multi_margin_loss.default" \
                and len(ins) > n_features:
            ins.append(feat)
        elif batched and tuple(s) == (first[0],) or not batched and tuple(s) == ():
            ins.append(row)
        else:
            raise Unsplittable(f"{call.op.target}: an argument of shape {tuple(s)} against "
                               f"inputs of {tuple(first)}")
    frozen = {"C": why}
    reduction = call.arg(at, "reduction", _MEAN)
    if reduction == 0:
        return Annotation(tuple(ins), (row,), frozen=frozen)
    lower = by_extent(lambda c, a, r, args, kw: _share(c, a, r, args, kw, reduction))
    return Annotation(tuple(ins), ((),), reduced=frozenset({"N"} if batched else ()),
                      frozen=frozen, lower=lower)
