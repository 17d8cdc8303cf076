"""Matrix products: linear, matmul, mm, bmm, addmm, baddbmm, einsum. The contracted dim is
reduced (parts give partial sums); a bias is added by part 0 of a value split only."""

from __future__ import annotations

import string
from collections.abc import Mapping

from ssdsl.ops.build import broadcast, first_value_part, plain, set_arg
from ssdsl.ops.core import Annotation, Call, Factor, Interval, LocalCall, by_extent, register


def _batch(shapes, prefix: str = "b"):
    """Broadcast signatures of the batch dims of several operands."""
    out_batch = _broadcast_shape(shapes)
    return broadcast(shapes, out_batch, prefix)


def _broadcast_shape(shapes):
    n = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(n):
        sizes = {s[len(s) - n + k] for s in shapes if len(s) - n + k >= 0} - {1}
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _drop_bias_outside_first(bias_pos: int, name: str):
    """Lowering for ops with a bias: a part off the start of a reduced dim must not add it."""
    @by_extent
    def lower(call: Call, ann: Annotation, ranges: Mapping[str, Interval], args: tuple,
              kwargs: dict) -> LocalCall:
        if not first_value_part(ann, ranges):
            args, kw = set_arg(args, kwargs, bias_pos, name, None)
            return LocalCall(call.op.target, args, kw)
        return LocalCall(call.op.target, args, tuple(kwargs.items()))
    return lower


# Megatron's vocabulary: a column-parallel linear splits its output features, a row-parallel one
# its input features (the contracted dim: partial sums).
FEATURE_WORDS = {"out": "n", "in": "k"}


@register("aten.linear.default")
def linear(call: Call) -> Annotation:
    x, w = call.shape(0, "input"), call.shape(1, "weight")
    (bsig,), bout = _batch([x[:-1]])
    n, k = w
    ins = [(*bsig, (Factor("k", k),)), ((Factor("n", n),), (Factor("k", k),))]
    if call.arg(2, "bias") is not None:
        ins.append(((Factor("n", n),),))
    return Annotation(tuple(ins), ((*bout, (Factor("n", n),)),), reduced=frozenset({"k"}),
                      words=FEATURE_WORDS, lower=_drop_bias_outside_first(2, "bias"))


@register("aten.matmul.default", "aten.mm.default", "aten.bmm.default")
def matmul(call: Call) -> Annotation:
    a, b = call.in_shapes
    if len(a) == 1 or len(b) == 1:
        a2, b2 = (a if len(a) > 1 else (1, *a)), (b if len(b) > 1 else (*b, 1))
    else:
        a2, b2 = a, b
    (sa, sb), bout = _batch([a2[:-2], b2[:-2]])
    m, k, n = a2[-2], a2[-1], b2[-1]
    asig = (*sa, (Factor("m", m),), (Factor("k", k),))
    bsig = (*sb, (Factor("k", k),), (Factor("n", n),))
    out = [*bout, (Factor("m", m),), (Factor("n", n),)]
    if len(a) == 1:
        asig, out = asig[-1:], out[:-2] + out[-1:]
    if len(b) == 1:
        bsig, out = bsig[-2:-1], out[:-1]
    # ``x @ weight.T`` (Falcon's linear, a hand-written one): a matrix on the right is a
    # linear's weight, and a plan names its dims as a linear's, ``out`` and ``in``
    words = FEATURE_WORDS if len(b) == 2 else {}
    return Annotation((asig, bsig), (tuple(out),), reduced=frozenset({"k"}),
                      names=_heads(a2, b2, bout), words=words)


def _heads(a, b, bout) -> dict[str, str]:
    """Attention written out (``q @ k.transpose(-2, -1)``, softmax, ``@ v``, as timm's default
    attention is) has the layout of ``sdpa``'s operands, (batch, heads, tokens, features): the
    innermost of two or more batch dims, present whole in both operands, introduces the flowing
    name ``heads``, as ``sdpa`` does. A dim named from the model's inputs keeps its name."""
    if len(bout) < 2 or len(a) < 4 or len(b) < 4 or a[-3] != b[-3] or a[-3] == 1:
        return {}
    return {bout[-1][0].label: "heads"}


@register("aten.addmm.default", "aten.baddbmm.default")
def addmm(call: Call) -> Annotation:
    bias, a, b = call.in_shapes
    (sa, sb), bout = _batch([a[:-2], b[:-2]])
    m, k, n = a[-2], a[-1], b[-1]
    out = (*bout, (Factor("m", m),), (Factor("n", n),))
    (bias_sig,), _ = broadcast([bias], [f.size for d in out for f in d])
    bias_sig = tuple(tuple(Factor(_rename(f.label, out), f.size) for f in d) for d in bias_sig)
    return Annotation((bias_sig, (*sa, (Factor("m", m),), (Factor("k", k),)),
                       (*sb, (Factor("k", k),), (Factor("n", n),))), (out,),
                      reduced=frozenset({"k"}), words=FEATURE_WORDS, lower=_drop_addmm_bias)


def _rename(label: str, out) -> str:
    # broadcast() names dims d0.. ; map them to the output's labels at the same position.
    if label.startswith("d") and label[1:].isdigit():
        return out[int(label[1:])][0].label
    return label


@by_extent
def _drop_addmm_bias(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    if first_value_part(ann, ranges):
        return LocalCall(call.op.target, args, tuple(kwargs.items()))
    # A part off the start of k computes alpha * (a @ b) only: without the bias slot, the bias
    # is not read there at all, so (as for a linear's bias) only the first part holds it and its
    # gradient needs no sum across the parts.
    (_, a, b), alpha = args[:3], args[4] if len(args) > 4 else kwargs.get("alpha", 1)
    target = "aten.mm.default" if call.op.target == "aten.addmm.default" else "aten.bmm.default"
    return LocalCall(target, (a, b), (), scale=float(alpha))


@register("aten.einsum.default")
def einsum(call: Call) -> Annotation:
    """Einsum is its own annotation: letters in the output are spatial, the others reduced."""
    eq = call.arg(0, "equation").replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    operands = lhs.split(",")
    shapes = call.in_shapes
    if not rhs and "->" not in eq:
        rhs = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
    ell = _ellipsis_labels(operands, shapes)
    sigs = [_einsum_sig(op, s, ell) for op, s in zip(operands, shapes)]
    (out,) = call.out_shapes
    out_sig = _einsum_sig(rhs, out, ell)
    sizes: dict[str, int] = {}
    for f in (f for sig in sigs for d in sig for f in d):
        sizes[f.label] = max(sizes.get(f.label, 1), f.size)
    out_labels = {f.label for d in out_sig for f in d}
    # an input label broadcast (size 1) against a bigger one elsewhere is renamed to stay whole
    sigs = [tuple(tuple(Factor(f.label if f.size == sizes[f.label] or f.size != 1
                               else f"{f.label}_b{t}", f.size) for f in d) for d in sig)
            for t, sig in enumerate(sigs)]
    reduced = frozenset(lab for lab in sizes if lab not in out_labels)
    return Annotation(tuple(sigs), (out_sig,), reduced=reduced)


def _ellipsis_labels(operands, shapes) -> list[str]:
    n = max((len(s) - len(op.replace("...", "")) for op, s in zip(operands, shapes)
             if "..." in op), default=0)
    return [f"e{i}" for i in range(n)]


def _einsum_sig(spec: str, shape, ell: list[str]):
    head, dots, tail = spec.partition("...")
    if dots:
        n = len(shape) - len(head) - len(tail)
        labels = [*head, *ell[len(ell) - n:], *tail]
    else:
        labels = list(spec)
    return plain(labels, shape)


__all__ = ["linear", "matmul", "einsum", "addmm", "string"]
