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

from ssdsl.ops.build import broadcast, dims, plain
from ssdsl.ops.core import Annotation, Call, Factor, Interval, LocalCall, by_extent, register

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


@register("aten.mse_loss.default", "aten.l1_loss.default", "aten.smooth_l1_loss.default",
          "aten.binary_cross_entropy_with_logits.default")
def pointwise_loss(call: Call) -> Annotation:
    x = call.shape(0, "self")
    labels = dims(len(x))
    # the target and any weight broadcast to the input's shape (``pos_weight`` of (C,) against
    # (N, C)): each read at its own shape, a dim broadcast from 1 whole by every part
    ins, sig = broadcast(call.in_shapes, x)
    reduction = call.arg(2, "reduction", _MEAN)
    if call.op.target == "aten.binary_cross_entropy_with_logits.default":
        reduction = call.arg(4, "reduction", _MEAN)
    if reduction == 0:
        return Annotation(ins, (sig,))
    lower = by_extent(lambda c, a, r, args, kw: _share(c, a, r, args, kw, reduction))
    return Annotation(ins, ((),), reduced=frozenset(labels), lower=lower)
