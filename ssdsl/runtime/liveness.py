"""Forward values the executor stops holding before a backward runs (the distributed executor's
``env``, not the program's ``Free``).

A forward unit leaves every value it made in the runner's ``env`` until the unit's backward is
over, where the program frees them (``Free`` after ``Backward``). Autograd keeps what the backward
needs itself; the ``env`` holding the rest keeps alive what eager PyTorch would already have
dropped: the logits once the loss has read them, an activation that only a later operator read.
On the peers' GPT at width 256, seq 256, vocabulary 4,096 and batch 32, one device, the process
peaked at 1,523 MB under ssdsl against 1,369 MB in eager, and at 1,399 MB with those values dropped
before the backward.

``dead_before_backwards(program)`` gives, for each backward that starts a walk (a whole
``Backward``, the first of two, or a split backward's ``BackwardInput``: a zero-bubble plan's
``I`` unit, or a rank's last backward split by the lowering), the values defined before it that
no instruction from it on reads (``ssdsl.lower.instr.reads``, what the checker reads too; a
two-walk backward's second walk reads what its first does, a ``BackwardWeight`` the kept
outputs, cuts and activations its weight gradients need) and no ``Free`` has freed yet: the
runner drops them from ``env`` alone. The program's own ``Free`` later frees them again (a no-op
for them) and the gradient tables as before; nothing else changes.

A split backward needs a mixing call's output only as a place in the autograd graph: where the
input half takes its gradient (kept for the weight half), and where the weight half's autograd
starts when no closed form applies (``ssdsl.runtime.wgrad``). ``held_as_edges(program)`` gives,
for each ``BackwardInput``, the kept outputs that nothing after it reads but as such a start: the
runner takes their gradient edges (``torch.autograd.graph.get_gradient_edge``: the node, not the
tensor), drops them from ``env`` before the input half, and asks autograd for the gradients at
the edges; so a split backward holds no logits in ``env`` either.
"""

from __future__ import annotations

from typing import Any

from ssdsl.lower.instr import (Backward, BackwardInput, BackwardWeight, Free, Program, reads,
                               writes)

# False: the runner holds every value until the program frees it (benchmarks compare)
ENABLED = True


def dead_before_backwards(program: Program) -> dict[int, tuple[Any, tuple[str, ...]]]:
    """``id(backward) -> (backward, the values to drop from env before it)`` for each
    ``Backward`` or ``BackwardInput`` of ``program`` that starts a walk and has any."""
    instructions = program.instructions
    last: dict[str, int] = {}
    for i, ins in enumerate(instructions):
        for v in reads(ins):
            last[v] = i
    live: dict[str, None] = {}  # defined and not freed yet, in order of definition
    out: dict[int, tuple[Any, tuple[str, ...]]] = {}
    for i, ins in enumerate(instructions):
        if isinstance(ins, Backward) and ins.part != "rest" or isinstance(ins, BackwardInput):
            dead = tuple(v for v in live if last.get(v, -1) < i)
            if dead:
                out[id(ins)] = (ins, dead)
                for v in dead:
                    del live[v]
        elif isinstance(ins, Free):
            for v in ins.values:
                live.pop(v, None)
        for v in writes(ins):
            live[v] = None
    return out


def held_as_edges(program: Program) -> dict[int, tuple[Any, tuple[str, ...]]]:
    """``id(backward_input) -> (it, the kept outputs held as gradient edges from it on)``: those
    no later instruction reads but as the start of a weight half's autograd (``_reads``)."""
    instructions = program.instructions
    if not any(isinstance(ins, BackwardInput) for ins in instructions):
        return {}
    last: dict[str, int] = {}
    for i, ins in enumerate(instructions):
        for v in _reads(ins):
            last[v] = i
    out: dict[int, tuple[Any, tuple[str, ...]]] = {}
    for i, ins in enumerate(instructions):
        if isinstance(ins, BackwardInput):
            other = {*ins.seeds, *ins.roots, *ins.inputs, *(leaf for leaf, _ in ins.collect)}
            gone = tuple(v for v in ins.keep if last.get(v, -1) <= i and v not in other)
            if gone:
                out[id(ins)] = (ins, gone)
    return out


def _reads(ins: Any) -> tuple[str, ...]:
    """``reads(ins)``, less each weight half's mixing calls' first outputs: the runner starts
    autograd there from the gradient edge the input half kept, and the closed forms read the
    calls' inputs (and a ``native_layer_norm``'s other outputs), not that output."""
    if isinstance(ins, BackwardWeight):
        return ins.seeds + ins.roots + tuple(
            v for outs, cuts in ins.mixes for v in (*outs[1:], *(x for c in cuts for x in c))
        ) + ins.inputs
    return reads(ins)


__all__ = ["ENABLED", "dead_before_backwards", "held_as_edges"]
