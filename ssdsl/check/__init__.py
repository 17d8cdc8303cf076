"""Phase 6, check: static checks of what the earlier phases decided.

``check_schedule`` runs the pipeline-schedule rules (``ssdsl.check.schedule``: every unit once, on
its device, after its data; ``ssdsl.check.deadlock``: no wait-for cycle once sends meet receives).
"""

from __future__ import annotations

from ssdsl.check.deadlock import CommModel, Deadlock, check_deadlock, find_stuck
from ssdsl.check.schedule import (DuplicateUnit, ForwardAfterBackward, MisplacedUnit, MissingUnit,
                                  OrderAgainstData, ScheduleError, SharedOrderMismatch, UnknownUnit,
                                  check_structure)
from ssdsl.schedule.units import Schedule


def check_schedule(schedule: Schedule, *, comm: CommModel = CommModel.ASYNC) -> None:
    """Raise the first failing rule's errors; return quietly when ``schedule`` can run."""
    check_structure(schedule)
    check_deadlock(schedule, comm=comm)


__all__ = ["CommModel", "Deadlock", "DuplicateUnit", "ForwardAfterBackward", "MisplacedUnit",
           "MissingUnit", "OrderAgainstData", "ScheduleError", "SharedOrderMismatch",
           "UnknownUnit", "check_deadlock",
           "check_schedule", "check_structure", "find_stuck"]

from ssdsl.check.program import (BadStepTail, BadUnitStructure, GatherNotFreed,  # noqa: E402
                                 OrderNotFollowed, ParamsNotGathered, RecomputeCommunicates,
                                 UndefinedValue, check_programs)
from ssdsl.lower.walk import (CollectiveMismatch, MessageMismatch, ProgramDeadlock,  # noqa: E402
                              ProgramError, UnmatchedSend)

__all__ += ["BadStepTail", "BadUnitStructure", "CollectiveMismatch", "GatherNotFreed",
            "MessageMismatch", "OrderNotFollowed", "ParamsNotGathered", "ProgramDeadlock", "ProgramError", "RecomputeCommunicates",
            "UndefinedValue", "UnmatchedSend", "check_programs"]
