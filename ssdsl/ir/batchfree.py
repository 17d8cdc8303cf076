"""Operators whose outputs need no batch: computed from parameters, buffers and constants alone.

A tied embedding's alias, rotary tables built from a buffer and ``arange``, a causal mask: such a
value is the same in every micro-batch and on every device, so a pipeline stage that reads it can
compute it instead of receiving it (``ssdsl.materialize.copies``), and a stage cut never has to
send it (``ssdsl.schedule.resolve``, the bytes a cut sends).
"""

from __future__ import annotations

from ssdsl.ir.graph import Graph

# an operator whose target names one of these draws random numbers: a copy would draw others
RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson",
                "exponential", "geometric", "cauchy", "log_normal")


def batch_free(g: Graph, keep: frozenset[str] = frozenset()) -> set[str]:
    """The operators that read only parameters, buffers and constants, or the outputs of other
    such operators, or nothing (``arange``), and that draw no random numbers, do not output the
    loss, change nothing in place and read no parameter of ``keep``."""
    sources = {*g.params, *g.buffers, *g.constants} - keep
    out: set[str] = set()
    made: set[str] = set()
    for op in g.ops:
        target = op.target.lower()
        words = target.split(".")
        base = words[1] if len(words) > 2 else words[0]
        if (any(word in target for word in RANDOM_WORDS) or g.output in op.outputs
                or base.endswith("_")):
            continue
        if all(x in sources or x in made for x in op.inputs):
            out.add(op.name)
            made.update(op.outputs)
    return out
