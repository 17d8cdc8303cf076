"""Embedding lookups: the index dims and the embedding dim are spatial; the vocabulary dim is
frozen (a vocabulary split needs a masked lookup, which no single ATen call does)."""

from __future__ import annotations

from ssdsl.ops.build import dims, plain
from ssdsl.ops.core import Annotation, Call, Factor, register


@register("aten.embedding.default")
def embedding(call: Call) -> Annotation:
    w, idx = call.shape(0, "weight"), call.shape(1, "indices")
    labels = dims(len(idx), "i")
    return Annotation(
        (((Factor("v", w[0]),), (Factor("c", w[1]),)), plain(labels, idx)),
        ((*plain(labels, idx), (Factor("c", w[1]),)),),
        frozen={"v": "a vocabulary split needs a masked lookup"},
        # each output row reads one row of the table: the vocabulary is no dim of the lookup's
        # iteration space (``op_cost``: else a token embedding weighs as much as the LM head)
        windows=frozenset({"v"}))
