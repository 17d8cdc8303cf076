"""Operators that make tensors from sizes: ``arange`` (a part makes its own range), ``zeros``,
``ones``, ``full`` (a part makes its local shape), and triangular masks."""

from __future__ import annotations

from ssdsl.ops.build import dims, lower_sizes, norm_dim, plain, set_arg
from ssdsl.ops.core import Annotation, Call, Factor, LocalCall, dim_intervals, register
from ssdsl.ops.errors import FrozenDimError


@register("aten.arange.default", "aten.arange.start", "aten.arange.start_step")
def arange(call: Call) -> Annotation:
    (n,) = call.out_shapes[0]
    return Annotation((), (((Factor("i", n),),),), generated=frozenset({"i"}), lower=_lower_arange)


def _lower_arange(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    # the tracer may have cut ``i`` into factors: the part's indices are the region of the one
    # output dim, which one arange can make only when it is a single interval
    (out_dim,) = ann.outputs[0]
    intervals = dim_intervals(out_dim, ranges)
    if len(intervals) != 1:
        raise FrozenDimError(f"operator '{call.op.name}' (arange) cannot make the strided part "
                             f"{list(intervals)} of its range",
                             hint="split the outermost factor of its dim, or replicate it")
    ((start, stop),) = intervals
    target = call.op.target
    if target == "aten.arange.default":
        first, step = 0, 1
    elif target == "aten.arange.start":
        first, step = args[0], 1
    else:
        first, step = args[0], args[2] if len(args) > 2 else kwargs.get("step", 1)
    kw = {k: v for k, v in kwargs.items() if k not in ("start", "end", "step")}
    return LocalCall("aten.arange.start_step",
                     (first + start * step, first + stop * step, step), tuple(kw.items()))


@register("aten.zeros.default", "aten.ones.default", "aten.empty.memory_format",
          "aten.full.default", "aten.new_zeros.default", "aten.new_ones.default",
          "aten.new_full.default", "aten.new_empty.default")
def filled(call: Call) -> Annotation:
    """A tensor made from its sizes. ``x.new_zeros(size)`` reads only ``x``'s dtype and device,
    so a dim of the new tensor with the size of ``x``'s dim at the same position shares its
    label (the batch of ``labels.new_zeros(labels.shape)`` flows on, as in a decoder's labels
    shifted right): a part makes its local piece beside its piece of ``x``. ``x``'s other dims
    are ignored: any piece of them gives the same tensor (a micro-batch makes Mistral's
    ``mask.new_ones(())`` from its own rows)."""
    (shape,) = call.out_shapes
    labels = dims(len(shape))
    new = call.op.target.startswith("aten.new_")
    if not new:
        return Annotation((), (plain(labels, shape),), generated=frozenset(labels),
                          lower=lower_sizes(0, "size"))
    src = call.in_shapes[0]
    aligned = len(src) == len(shape)
    src_labels = [labels[k] if aligned and s == shape[k] else f"x{k}" for k, s in enumerate(src)]
    ignored = frozenset(lab for lab in src_labels if lab.startswith("x"))
    return Annotation((plain(src_labels, src),), (plain(labels, shape),),
                      generated=frozenset(labels), ignored=ignored, lower=lower_sizes(1, "size"))


@register("aten.tril.default", "aten.triu.default")
def triangle(call: Call) -> Annotation:
    (shape,) = call.in_shapes
    labels = dims(len(shape))
    frozen = {lab: "the diagonal is aligned to the first row and column"
              for lab in labels[-2:]}
    return Annotation((plain(labels, shape),), (plain(labels, shape),), frozen=frozen)


__all__ = ["arange", "filled", "triangle", "norm_dim", "set_arg", "LocalCall"]
