"""The step's loss summed while the step still runs (the distributed executor only).

A pipeline's step ends ``... WaitSends, LossSum, OptimizerStep``: ``LossSum`` all-reduces the
loss parts each rank counts, so every rank waits there for the slowest one (the first stage,
whose last backward comes last), and the slowest one then waits a round trip more before its
optimizer step. But a rank's loss parts are known as soon as it has run its last forward with a
loss call (the last stage), or from the start (a rank that holds no loss part adds zero). So
``loss_plan`` finds, for a rank's program, the unit after whose end its share is final, and the
executor starts the all-reduce there, asynchronously; ``LossSum`` only waits for it where the
program puts it. The slowest rank finds it complete when it gets there.

This changes nothing that the checker checked (``ssdsl.check.program``): every rank issues the
same all-reduce of the same values on the same group, once per step; only when it is issued
moves. That is safe when nothing else meets on that group during the step: collectives of one
group pair in the order each member issues them, and an all-reduce moved past another one of
its group would pair with it. So ``loss_plan`` gives None (the all-reduce stays where it stands)
when the program has any other collective on the loss's group; collectives on other groups
go through other process groups, which pair their own collectives apart. A collective on the
loss's group is one every member runs, so every member's program shows it, and every member
decides alike.
"""

from __future__ import annotations

import attrs

from ssdsl.lower.instr import Coll, Program

# False leaves the loss's all-reduce where ``LossSum`` stands (benchmarks compare)
ENABLED = True


@attrs.frozen
class LossPlan:
    """Start the loss's all-reduce over ``group`` at the end of unit ``after`` (the ordinal of
    its ``End`` in the program), or before anything runs when ``after`` is -1."""

    after: int
    group: tuple[int, ...]


def _meets_on(ins, members: tuple[int, ...]) -> bool:
    """Whether ``ins`` runs a collective on the group ``members`` (in any member order)."""
    k = ins.kind
    if k in ("reduce", "gather", "gather_params"):
        return tuple(sorted(ins.group)) == members
    if k in ("comm", "local"):
        return any(isinstance(s, Coll) and getattr(s, "meets", False)
                   and tuple(sorted(s.group)) == members for s in ins.steps)
    return False


def loss_plan(program: Program) -> LossPlan | None:
    """Where ``program``'s ``LossSum`` may start (see the module docstring), or None.

    >>> loss_plan(Program(0, 1, ()))
    """
    if not ENABLED:
        return None
    sums = [ins for ins in program.instructions if ins.kind == "loss_sum"]
    if len(sums) != 1 or len(sums[0].group) < 2:
        return None
    members = tuple(sorted(sums[0].group))
    ends, after, inside = -1, -1, False
    for ins in program.instructions:
        k = ins.kind
        if k == "loss_sum":
            break
        if _meets_on(ins, members):
            return None
        if k == "begin":
            inside = True
        elif k == "end":
            ends += 1
            if inside == "loss":
                after = ends
            inside = False
        elif k == "call" and ins.loss:
            if not inside:  # a loss call outside every unit: keep it where it is
                return None
            inside = "loss"
    return LossPlan(after, sums[0].group)
