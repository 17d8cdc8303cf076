"""Scaled dot-product attention. Batch and heads are spatial (heads introduces the flowing name
``heads``), the value dim too; the key sequence and the query-key dim are inside the softmax, and
the query sequence is frozen under a causal mask (a part's mask would restart at its first row).
The scale is pinned to the full op's value, so it cannot follow a local dim."""

from __future__ import annotations

import math

from ssdsl.ops.build import plain, set_arg
from ssdsl.ops.core import Annotation, Call, Factor, LocalCall, by_extent, register


@register("aten.scaled_dot_product_attention.default")
def sdpa(call: Call) -> Annotation:
    q, k, v = call.shape(0, "query"), call.shape(1, "key"), call.shape(2, "value")
    lead = len(q) - 2
    batch = [f"b{i}" for i in range(lead)]
    gqa = bool(call.arg(7, "enable_gqa", False)) and lead >= 1 and q[-3] != k[-3]
    qs = [(Factor(b, s),) for b, s in zip(batch, q[:-2])]
    ks = [(Factor(b, s),) for b, s in zip(batch, k[:-2])]
    names = {}
    if lead >= 2:
        names[batch[-1]] = "heads"
    if gqa:  # query heads are (kv_heads rep): a key/value head serves rep query heads
        rep = q[-3] // k[-3]
        qs[-1] = (Factor(batch[-1], k[-3]), Factor("rep", rep))
    L, E, S, Ev = q[-2], q[-1], k[-2], v[-1]
    q_sig = (*qs, (Factor("L", L),), (Factor("E", E),))
    k_sig = (*ks, (Factor("S", S),), (Factor("E", E),))
    v_sig = (*ks, (Factor("S", S),), (Factor("Ev", Ev),))
    out = (*qs, (Factor("L", L),), (Factor("Ev", Ev),))
    ins = [q_sig, k_sig, v_sig]
    frozen = {"S": "attention normalizes over the keys",
              "E": "inside the query-key product under the softmax"}
    mask = call.arg(3, "attn_mask")
    if mask is not None:
        ins.append(_mask_sig(call.info(mask).shape, [*qs, (Factor("L", L),), (Factor("S", S),)],
                             frozen))
    if call.arg(5, "is_causal", False):
        frozen["L"] = "a causal mask is aligned to the first query of the op"
    return Annotation(tuple(ins), (out,), frozen=frozen, names=names, lower=_pin_scale)


def _mask_sig(shape, target, frozen: dict) -> tuple:
    """A mask broadcast against ``(*batch, L, S)``: a dim of the target's size shares its label."""
    offset = len(target) - len(shape)
    sig = []
    for j, s in enumerate(shape):
        dim = target[offset + j]
        if len(dim) == 1 and dim[0].size == s:
            sig.append(dim)
        else:
            sig.append((Factor(f"m{j}", s),))
            frozen[f"m{j}"] = "a mask dim broadcast over the scores"
    return tuple(sig)


@by_extent
def _pin_scale(call: Call, ann: Annotation, ranges, args: tuple, kwargs: dict) -> LocalCall:
    scale = call.arg(6, "scale")
    if scale is None:
        scale = 1.0 / math.sqrt(call.shape(0, "query")[-1])
    args, kw = set_arg(args, kwargs, 6, "scale", scale)
    return LocalCall(call.op.target, args, kw)


__all__ = ["sdpa", "plain"]
