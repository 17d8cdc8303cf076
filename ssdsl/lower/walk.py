"""The one walk over a per-rank program, and the meeting rules of communication.

``walk(program, handler)`` visits the instructions in order and calls ``handler.on_<kind>(ins)``.
Backends differ only in their handlers: the distributed executor communicates on
torch.distributed; the in-process simulator and the checker run every rank's walk in one process
(``run_all``), where a handler *yields* a ``Wait`` wherever its rank must meet others (a receive,
a collective) and ``Exchange`` completes the waits by the rules the ranks will follow:

- a send never blocks: it is posted to the mailbox under (source, destination, tag);
- a receive completes when the matching send was posted; its shape must be the sent one's;
- a collective is a meeting point of its group: it completes when every member waits on a
  collective of that group, and all of them must be the same one (same step of the same adapter,
  micro-batch and direction), else the ranks would pair the wrong collectives.

When no rank can move, the programs deadlock (``ProgramDeadlock``, at the first stuck
instruction's plan line); a send nobody receives is ``UnmatchedSend``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from ssdsl.errors import SsdslError
from ssdsl.lower.instr import MAX_TAG, Coll, Msg, Program
from ssdsl.source import Span


class ProgramError(SsdslError):
    """Root of the faults found in lowered per-rank programs."""


class ProgramDeadlock(ProgramError):
    """Every rank that has not finished waits on something no rank will ever do."""


class CollectiveMismatch(ProgramError):
    """Members of a group issue different collectives at the same point."""


class UnmatchedSend(ProgramError):
    """A message is sent that no rank receives (or is sent twice under one tag)."""


class MessageMismatch(ProgramError):
    """A receive expects another shape than the matching send has."""


class Handler:
    """Base of the instruction handlers: ``visit`` dispatches on the instruction's kind.

    A handler method returns ``None`` or an iterator of ``Wait``s (a generator that yields where
    its rank must meet others; the distributed executor never yields)."""

    def visit(self, ins: Any) -> Iterator[Wait] | None:
        return getattr(self, "on_" + ins.kind)(ins)


def walk(program: Program, handler: Handler) -> Iterator[Wait]:
    """Visit ``program``'s instructions in order; yield the waits the handler asks for."""
    for ins in program.instructions:
        waits = handler.visit(ins)
        if waits is not None:
            yield from waits


@attrs.define(eq=False)
class Wait:
    """Rank ``rank`` waits at ``ins``: a collective ``what`` (a ``Coll``) on its group, or a
    receive ``what`` (a ``Msg``). ``ident`` names the adapter step the collective belongs to;
    ``payload`` is what the rank contributes; ``result`` is filled on completion."""

    rank: int
    what: Coll | Msg
    ins: Any
    ident: tuple = ()
    payload: Any = None
    shape: tuple[int, ...] | None = None
    result: Any = None


@attrs.define(eq=False)
class _Sent:
    rank: int
    msg: Msg
    ins: Any
    payload: Any
    shape: tuple[int, ...] | None


Combine = Callable[[Coll, list[Any]], list[Any]]


class Exchange:
    """Mailbox and meeting points shared by every rank's walk in one process. ``combine`` turns
    the members' payloads of a collective (in group order) into their results."""

    def __init__(self, combine: Combine | None = None) -> None:
        self.mail: dict[tuple[int, int, int], _Sent] = {}
        self.combine = combine
        self.fresh: list[tuple[int, int, int]] = []  # keys posted since ``run_all`` looked

    def send(self, rank: int, msg: Msg, ins: Any, payload: Any = None,
             shape: tuple[int, ...] | None = None) -> None:
        """Post a message (never blocks)."""
        if not 0 <= msg.tag <= MAX_TAG:
            raise UnmatchedSend(f"rank {rank} sends a message with tag {msg.tag} to rank "
                                f"{msg.peer}: a program's tags run from 0 to {MAX_TAG} (gloo's "
                                "are 32-bit, and the next one is the runtime's own)",
                                span_of(ins), hint=_HINT)
        key = (rank, msg.peer, msg.tag)
        if key in self.mail:
            raise UnmatchedSend(f"rank {rank} sends a second message with tag {msg.tag} to rank "
                                f"{msg.peer} before the first was received", span_of(ins),
                                hint=_HINT)
        self.mail[key] = _Sent(rank, msg, ins, payload, shape)
        self.fresh.append(key)

    def try_recv(self, w: Wait) -> bool:
        key = (w.what.peer, w.rank, w.what.tag)
        sent = self.mail.pop(key, None)
        if sent is None:
            return False
        if w.shape is not None and sent.shape is not None and tuple(w.shape) != tuple(sent.shape):
            raise MessageMismatch(f"rank {w.rank} receives a {list(w.shape)} tensor with tag "
                                  f"{w.what.tag} from rank {w.what.peer}, which sends "
                                  f"{list(sent.shape)}", span_of(w.ins), hint=_HINT)
        want, got = getattr(w.payload, "dtype", None), getattr(sent.payload, "dtype", None)
        if want is not None and got is not None and want != got:
            # on the wire the bytes would be read as another dtype: garbage, silently
            raise MessageMismatch(f"rank {w.rank} receives a {want} tensor with tag "
                                  f"{w.what.tag} from rank {w.what.peer}, which sends {got}",
                                  span_of(w.ins), hint=_HINT)
        w.result = sent.payload
        return True

    def try_collective(self, w: Wait, pending: Mapping[int, Wait]) -> list[Wait]:
        coll = w.what
        if w.rank not in coll.group:
            raise CollectiveMismatch(f"rank {w.rank} issues a {coll.kind} of group "
                                     f"{list(coll.group)}, which it is not in", span_of(w.ins),
                                     hint=_HINT)
        members = [pending.get(r) for r in coll.group]
        if any(m is None or not isinstance(m.what, Coll) or m.what.group != coll.group
               for m in members):
            return []
        for m in members:
            if m.what != coll or m.ident != w.ident:
                raise CollectiveMismatch(
                    f"ranks {list(coll.group)} meet at different collectives: rank {w.rank} at "
                    f"{_describe(w)}, rank {m.rank} at {_describe(m)}", span_of(m.ins),
                    hint="every member of a group must issue its collectives in the same order")
        results = (self.combine(coll, [m.payload for m in members]) if self.combine
                   else [None] * len(members))
        for m, r in zip(members, results):
            m.result = r
        return members

    def leftover(self) -> None:
        """Raise for a message sent and never received."""
        for sent in self.mail.values():
            raise UnmatchedSend(f"rank {sent.rank} sends a message with tag {sent.msg.tag} to "
                                f"rank {sent.msg.peer}, which never receives it",
                                span_of(sent.ins), hint=_HINT)


_HINT = "this is a fault of the lowered programs; if no program was edited, please report it"


def _describe(w: Wait) -> str:
    what = w.what
    ident = " ".join(str(x) for x in w.ident)
    return f"{what.kind} of {list(what.group)} ({ident})" if isinstance(what, Coll) else str(what)


def span_of(ins: Any) -> Span | None:
    return getattr(ins, "span", None)


def run_all(walks: Mapping[int, Iterator[Wait]], exchange: Exchange) -> None:
    """Run every rank's walk to its end in this process, completing waits as ranks meet.

    Event-driven, so the work is linear in the waits: a rank is advanced when it starts or its
    wait completed; a receive is tried when it is reached and again when its message is posted;
    a collective once every member of its group waits at one of that group (counted as the
    waits arrive: a loss sum over all 1,024 ranks is not checked against the whole group on each
    turn). Sends never block and a message is matched by its (source, destination, tag), so the
    ranks end where they would in any order of turns; when none can move while some have not
    finished, they deadlock."""
    live = dict(walks)
    pending: dict[int, Wait] = {}
    waiting: set[tuple[int, int, int]] = set()  # keys of awaited messages (the rank: key[1])
    at: dict[tuple[int, ...], int] = {}  # group -> its members pending at a collective of it
    members: dict[tuple[int, ...], frozenset[int]] = {}
    ready = deque(sorted(live))
    exchange.fresh.clear()
    while ready:
        rank = ready.popleft()
        try:
            w = next(live[rank])
        except StopIteration:
            del live[rank]
            w = None
        if w is not None:
            what = w.what
            if isinstance(what, Msg):
                if exchange.try_recv(w):
                    ready.append(rank)
                else:
                    pending[rank] = w
                    waiting.add((what.peer, rank, what.tag))
            else:
                group = what.group
                mine = members.get(group)
                if mine is None:
                    mine = members[group] = frozenset(group)
                if rank not in mine:
                    exchange.try_collective(w, pending)  # raises: not in its group
                pending[rank] = w
                at[group] = at.get(group, 0) + 1
                if at[group] == len(mine):
                    for d in exchange.try_collective(w, pending):
                        del pending[d.rank]
                        at[group] -= 1
                        ready.append(d.rank)
        if exchange.fresh:  # messages the rank sent on its way: their receivers may go on
            fresh, exchange.fresh = exchange.fresh, []
            for key in fresh:
                if key in waiting:
                    waiting.discard(key)
                    r = key[1]  # its destination
                    if exchange.try_recv(pending[r]):
                        del pending[r]
                        ready.append(r)
    if live:
        _deadlock(pending)
    exchange.leftover()


def _deadlock(pending: Mapping[int, Wait]) -> None:
    for w in pending.values():
        if not isinstance(w.what, Coll):
            continue
        others = [pending.get(r) for r in w.what.group]
        if all(o is not None and isinstance(o.what, Coll) for o in others):
            odd = next((o for o in others if (o.what, o.ident) != (w.what, w.ident)), None)
            if odd is not None:  # every member waits at a collective, not the same one
                raise CollectiveMismatch(
                    f"ranks {list(w.what.group)} meet at different collectives: rank {w.rank} "
                    f"at {_describe(w)}, rank {odd.rank} at {_describe(odd)}", span_of(w.ins),
                    hint="every member of a group must issue its collectives in the same order")
    lines = []
    for rank, w in sorted(pending.items()):
        if isinstance(w.what, Msg):
            lines.append(f"rank {rank} waits to receive tag {w.what.tag} from rank "
                         f"{w.what.peer}")
        else:
            lines.append(f"rank {rank} waits in a {_describe(w)}")
    first = min(pending.values(), key=lambda w: (span_of(w.ins) is None, w.rank))
    raise ProgramDeadlock("the ranks' programs deadlock: " + "; ".join(lines),
                          span_of(first.ins), hint=_HINT)
