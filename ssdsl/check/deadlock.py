"""Deadlock detection: run the programs with every cross-device dependency as a send and a receive.

Each device's program is expanded into operations: before a unit, one receive per input that
another device produces; the unit; after it, one send per device that consumes its result
(receives in the order of ``data_deps``, sends in the order of the consumers). Messages are
identified by (producer unit, consumer unit), as a tag would identify them, so messages on one
channel need not arrive in the order they are received.

Two communication models:

- ``ASYNC`` (what the runtime does): sends are posted asynchronously and never block; a receive
  blocks until its message has been sent. A schedule deadlocks only if devices wait in a cycle of
  receives.
- ``RENDEZVOUS``: a send also blocks until the peer reaches the matching receive (unbuffered
  blocking point-to-point). Stricter: plain 1F1B deadlocks under it, because in the steady state
  device d sends an activation forward while device d+1 sends a gradient back.

A unit of a shared stage (``StageGraph.hosts``: the interlaced pipeline's embedding, on every
device) is a meeting point, as a collective is: no device gets past it until all its devices have
reached it, under either model.

A stuck run is reported as a ``Deadlock`` whose message holds a grid of devices by program steps
with the stuck units marked: ``[1B0]`` waits to receive an input of 1B0, ``[1B0>]`` has run 1B0 and
waits to hand its result over.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable

import attrs

from ssdsl.check.schedule import ScheduleError
from ssdsl.schedule.deps import Message, messages
from ssdsl.schedule.grid import program_grid
from ssdsl.schedule.units import Schedule, Unit
from ssdsl.source import Span


class CommModel(enum.Enum):
    ASYNC = "async"
    RENDEZVOUS = "rendezvous"


class Deadlock(ScheduleError):
    """Devices wait for each other forever once sends are matched with receives.

    ``details`` (who waits for what, and the grid of stuck units) is printed after the source line.
    """

    def __init__(self, message: str, spans: Iterable[Span | None], *, details: str,
                 hint: str | None = None) -> None:
        super().__init__(message, spans, hint=hint)
        self.details = details

    def render(self) -> str:
        head, _, rest = super().render().partition("\nhint: ")
        parts = [head, self.details]
        return "\n".join(parts + ([f"hint: {rest}"] if rest else []))


# Operation kinds of an expanded program.
_RECV, _RUN, _SEND = 0, 1, 2


@attrs.frozen
class _Op:
    kind: int
    step: int  # index of the unit in the device's program this operation belongs to
    unit: Unit
    msg: Message | None = None


@attrs.frozen
class Stuck:
    """Where a device stopped: its operation and the device it waits for."""

    device: int
    op: _Op
    waits_for: int


def _expand(schedule: Schedule) -> list[list[_Op]]:
    incoming: dict[Unit, list[Message]] = defaultdict(list)
    outgoing: dict[Unit, list[Message]] = defaultdict(list)
    for msg in messages(schedule):
        incoming[msg.dst].append(msg)
        outgoing[msg.src].append(msg)
    for lst in outgoing.values():
        lst.sort(key=lambda m: m.dst)
    ops: list[list[_Op]] = []
    for prog in schedule.programs:
        mine: list[_Op] = []
        for k, unit in enumerate(prog.units):
            mine += [_Op(_RECV, k, unit, msg) for msg in incoming.get(unit, ())]
            mine.append(_Op(_RUN, k, unit))
            mine += [_Op(_SEND, k, unit, msg) for msg in outgoing.get(unit, ())]
        ops.append(mine)
    return ops


def _peer(op: _Op) -> int:
    assert op.msg is not None
    return op.msg.src_device if op.kind == _RECV else op.msg.dst_device


class _Meetings:
    """The units of shared stages, where every device of the stage waits for the others."""

    def __init__(self, schedule: Schedule) -> None:
        self.g = schedule.stages
        self.arrived: dict[Unit, set[int]] = defaultdict(set)

    def blocks(self, d: int, op: _Op) -> bool:
        """Whether device d, at ``op``, must wait for another device of a shared unit."""
        if op.kind != _RUN or not self.g.shared(op.unit.stage):
            return False
        here = self.arrived[op.unit]
        here.add(d)
        return len(here) < len(self.g.hosts[op.unit.stage])

    def absent(self, op: _Op) -> int:
        """A device of ``op``'s shared unit that has not reached it."""
        return min(set(self.g.hosts[op.unit.stage]) - self.arrived[op.unit])


def _step_async(d: int, ops: list[_Op], pc: int, sent: set[Message], woken: list,
                meet: _Meetings) -> int:
    """Advance one device as far as it goes alone; returns its new program counter and lists the
    messages it sent (and the shared units it completed) in ``woken``."""
    while pc < len(ops):
        op = ops[pc]
        if op.kind == _RECV and op.msg not in sent:
            break
        if meet.blocks(d, op):
            break
        if op.kind == _RUN and meet.g.shared(op.unit.stage):
            woken.append(op.unit)
        if op.kind == _SEND:
            sent.add(op.msg)  # type: ignore[arg-type]
            woken.append(op.msg)  # type: ignore[arg-type]
        pc += 1
    return pc


def _run_async(ops: list[list[_Op]], meet: _Meetings) -> list[int]:
    pcs = [0] * len(ops)
    sent: set[Message] = set()
    # Wake a device only when the message it waits for is sent (or the last device of the
    # shared unit it waits at arrives): linear in the operations.
    waiting: dict[Message | Unit, list[int]] = defaultdict(list)
    todo = list(range(len(ops)))
    while todo:
        d = todo.pop()
        woken: list = []
        pcs[d] = _step_async(d, ops[d], pcs[d], sent, woken, meet)
        if pcs[d] < len(ops[d]):
            op = ops[d][pcs[d]]
            waiting[op.msg if op.kind != _RUN else op.unit].append(d)
        for key in woken:
            todo += waiting.pop(key, [])
    return pcs


def _run_rendezvous(ops: list[list[_Op]], meet: _Meetings) -> list[int]:
    pcs = [0] * len(ops)

    def head(d: int) -> _Op | None:
        return ops[d][pcs[d]] if pcs[d] < len(ops[d]) else None

    done: set[Unit] = set()
    progress = True
    while progress:
        progress = False
        for d in range(len(ops)):
            while (op := head(d)) is not None:
                if op.kind == _RUN:
                    if op.unit not in done and meet.blocks(d, op):
                        break
                    done.add(op.unit)
                    pcs[d] += 1
                    progress = True
                    continue
                other = head(_peer(op))
                if other is None or other.msg != op.msg or other.kind == op.kind:
                    break
                pcs[d] += 1
                pcs[_peer(op)] += 1
                progress = True
    return pcs


def _cycle(stuck: dict[int, Stuck]) -> list[int]:
    """The devices on the wait-for cycle reached from the lowest stuck device."""
    path: list[int] = []
    d = min(stuck)
    while d not in path:
        path.append(d)
        d = stuck[d].waits_for
        if d not in stuck:  # waits for a finished device: cannot happen, but never loop
            return path
    cycle = path[path.index(d):]
    first = cycle.index(min(cycle))  # start at the lowest device: stable messages and spans
    return cycle[first:] + cycle[:first]


def find_stuck(schedule: Schedule, *, comm: CommModel = CommModel.ASYNC) -> dict[int, Stuck]:
    """Run the expanded programs; the devices that never finish, by device (empty when none)."""
    ops = _expand(schedule)
    run = _run_async if comm is CommModel.ASYNC else _run_rendezvous
    meet = _Meetings(schedule)
    pcs = run(ops, meet)
    return {d: Stuck(d, ops[d][pc], meet.absent(ops[d][pc]) if ops[d][pc].kind == _RUN
                     else _peer(ops[d][pc]))
            for d, pc in enumerate(pcs) if pc < len(ops[d])}


def _explain(s: Stuck) -> str:
    msg = s.op.msg
    if s.op.kind == _RUN:
        return (f"device {s.device} waits at {s.op.unit}, a unit of a shared stage, for device "
                f"{s.waits_for} to reach it")
    assert msg is not None
    if s.op.kind == _RECV:
        return (f"device {s.device} waits before {s.op.unit} for {msg.src} from device "
                f"{msg.src_device}")
    return f"device {s.device} has run {s.op.unit} and waits to send it to {msg.dst} on device " \
           f"{msg.dst_device}"


def _mark(s: Stuck) -> str:
    return f"[{s.op.unit}]" if s.op.kind != _SEND else f"[{s.op.unit}>]"


def check_deadlock(schedule: Schedule, *, comm: CommModel = CommModel.ASYNC) -> None:
    """Raise ``Deadlock`` when the programs of ``schedule`` cannot all finish under ``comm``.

    Assumes ``check_structure`` passed (every unit once, local order respects data).
    """
    stuck = find_stuck(schedule, comm=comm)
    if not stuck:
        return
    cycle = _cycle(stuck)
    marks = {(s.device, s.op.step): _mark(s) for s in stuck.values()}
    grid = program_grid(schedule, marks)
    why = "\n".join(_explain(stuck[d]) for d in cycle)
    names = ", ".join(str(d) for d in cycle)
    spans = [schedule.programs[d].spans[stuck[d].op.step] for d in cycle]
    hint = ("reorder the units so that every unit's inputs are produced before any device waits "
            "for them")
    if comm is CommModel.RENDEZVOUS:
        hint += "; with blocking sends, a send and the opposite receive must be posted together"
    raise Deadlock(f"deadlock ({comm.value} sends): devices {names} wait for each other in a "
                   f"cycle", spans, details=f"{why}\n{grid}", hint=hint)
