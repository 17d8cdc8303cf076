"""Receives posted before the instruction that waits for them (the distributed executor only).

On gloo a message travels only once its receive is posted: the receiver announces the buffer and
the sender's bytes follow. A receive posted where the program waits for it therefore costs a round
trip on the critical path, and the sender's buffer stays in flight until then. ``early_receives``
lists, for each unit of a rank's program, the receives of that unit and of the next ``lookahead``
units; the executor posts them (``irecv`` into a fresh buffer) when the unit begins, and the
instruction that needs a message waits on its posted request where the program says.

This cannot change what the checker checked (``ssdsl.check.program``): every rank still blocks at
the same instructions, in the same order, and a message is matched by its (peer, tag), which is
unique in the program (a key that occurs twice is never posted early: two receives of it could
pair with the sends in either order). Posting a receive is not a meeting: it waits for nothing.
"""

from __future__ import annotations

from collections import Counter

import attrs

from ssdsl.lower.instr import P2P, Program

# units ahead of the running one whose receives are posted at its start: one keeps the receive
# buffers of at most two units alive at once, which is what 1F1B's steady state needs (the
# forward input of the next micro-batch and the gradient of the next backward); -1 posts none
# early (benchmarks compare)
LOOKAHEAD = 1


@attrs.frozen
class EarlyRecv:
    """A receive of ``shape`` (program dtype name ``dtype``) from ``peer`` under ``tag``."""

    peer: int
    tag: int
    shape: tuple[int, ...]
    dtype: str


def _unit_receives(program: Program) -> list[tuple[str, list[EarlyRecv]]]:
    """The receives of each unit, in program order."""
    out: list[tuple[str, list[EarlyRecv]]] = []
    for ins in program.instructions:
        if ins.kind == "begin":
            out.append((ins.unit, []))
        elif ins.kind == "comm" and out:
            out[-1][1].extend(EarlyRecv(m.peer, m.tag, tuple(m.region.local_shape), ins.dtype)
                              for step in ins.steps if isinstance(step, P2P)
                              for m in step.msgs if m.kind == "recv")
    return out


def early_receives(program: Program, *, lookahead: int | None = None
                   ) -> tuple[tuple[EarlyRecv, ...], ...]:
    """For the ``i``-th unit of the program (its ``i``-th ``Begin``), the receives to post when
    it begins: each receive of unit ``j`` at the start of unit ``max(0, j - lookahead)``, except
    those whose (peer, tag) is not unique in the program.

    >>> early_receives(Program(0, 1, ()))
    ()
    """
    lookahead = LOOKAHEAD if lookahead is None else lookahead
    units = _unit_receives(program)
    if lookahead < 0:  # posting off: every receive where its instruction waits
        return ()
    count = Counter((r.peer, r.tag) for _, rs in units for r in rs)
    plan: list[list[EarlyRecv]] = [[] for _ in units]
    for j, (_, rs) in enumerate(units):
        plan[max(0, j - lookahead)].extend(r for r in rs if count[(r.peer, r.tag)] == 1)
    return tuple(tuple(rs) for rs in plan)
