"""Lower the elaborated ``microbatch`` / ``stages`` / ``assign`` / ``order`` directives to a Schedule.

- ``microbatch ... into m`` gives the micro-batch count (1 without one).
- ``stages ... as st`` names the stages; ``assign st[i] to devices G`` puts stage i on the device
  group G. Stages whose groups are equal share a pipeline rank (interleaved chunks); a group of
  several devices (a stage that is also data- or tensor-parallel) is one *pipeline rank* whose
  devices all run the same program, so the schedule is built over ranks: ``Lowered.groups[r]``
  are the devices of rank r. Groups that overlap without being equal (the interlaced pipeline:
  the embedding on devices 0..4, stage 1 on device 0) split into *device classes*, the devices
  that run the same stages (``_classes``): each class is a rank, and a stage whose group holds
  several is *shared* by them (``StageGraph.hosts``): each runs all its units.
- ``order on devices G: ...`` sequences concatenate, in plan order, into the program of G's rank
  (of each of its ranks when G is a shared stage's group); every unit keeps the span of its
  statement, so the checker's errors point at it. On a rank that runs shared and own stages
  the two sequences are interlaced by time (``_interlace_by_time``). Where that finds nothing
  (no rank runs own units, or the shared sequences concatenated contradict the data) and a rank
  runs the orders of several device groups (stage 0 on devices 0..2 and stage 1 on 1..3, one
  statement each), the groups' orders are merged (``_merge_groups``): one topological order of
  all units that keeps each group's order and the data, the earlier statement first where both
  are free; each rank runs its units in that order. No such order is ``OrderConflict`` at the
  statement, naming the two units that it and the other orders need the other way round.
- A rank with no sequence gets the default order: a topological order of data edges plus the
  ``a before b`` edges, GPipe-like where they leave a choice (forwards first, by micro-batch).
  On ranks with a sequence, ``a before b`` is checked against it (``OrderConflict``).
- A cycle of ``before`` edges and data edges is an error at the ``before`` statements on it.

The stage DAG (which stage feeds which) comes from the traced graph; without it, a chain.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Sequence

import attrs

from ssdsl.elaborate.directives import (Assign, Microbatch, OrderBefore, OrderSequence, PartOf,
                                        StageRef, Stages, WorkUnit)
from ssdsl.errors import ErrorCollector, SsdslError
from ssdsl.schedule.deps import data_deps, required_units
from ssdsl.schedule.units import Pass, Program, Schedule, StageGraph, Unit
from ssdsl.source import Span

_PASSES = {"forward": Pass.F, "backward": Pass.B, "input_grad": Pass.I, "weight_grad": Pass.W}


class LowerError(SsdslError):
    """Root of the errors of lowering schedule directives."""


class UnassignedStage(LowerError):
    """A stage is never assigned to a device."""


class StageAssignedTwice(LowerError):
    """A stage is assigned to two different device groups."""


class UnsupportedOrderUnit(LowerError):
    """An order statement names something other than a pass of a stage for a micro-batch."""


class OrderConflict(LowerError):
    """An ``a before b`` statement contradicts an order sequence or the data dependencies, or
    the orders of device groups that meet on a device cannot be merged there."""


class SeveralPipelines(LowerError):
    """More than one ``stages`` statement: one pipeline per plan is supported."""


@attrs.frozen
class Lowered:
    """A schedule over pipeline ranks; ``groups[r]`` are the devices rank r stands for."""

    schedule: Schedule
    groups: tuple[tuple[int, ...], ...]
    stage_name: str


def _stages(directives: Sequence[object]) -> Stages | None:
    found = [d for d in directives if isinstance(d, Stages)]
    if len(found) > 1:
        raise SeveralPipelines("a second 'stages' statement; a plan has one pipeline",
                               found[1].span, hint=f"the first is at {found[0].span}")
    return found[0] if found else None


def _stage_groups(directives: Sequence[object], st: Stages) -> list[tuple[int, ...]]:
    groups: dict[int, tuple[tuple[int, ...], Span]] = {}
    # ``assign part k of st[i] to device d`` (one statement per part, or ``assign each part``):
    # the stage's group is the union of its parts' devices, in the order they are named
    by_parts: dict[int, tuple[list[int], Span]] = {}
    errors = ErrorCollector()
    for d in directives:
        if not isinstance(d, Assign):
            continue
        prefix, base = _part_prefix(d.selector)
        if not isinstance(base, StageRef) or base.group != st.name:
            continue
        i = base.index
        if prefix:
            devs, _ = by_parts.setdefault(i, ([], d.span))
            devs += [x for x in d.devices if x not in devs]
            continue
        if i in groups and groups[i][0] != d.devices:
            errors.add(StageAssignedTwice(
                f"stage {st.name}[{i}] is assigned to devices {list(d.devices)} here and to "
                f"{list(groups[i][0])} at line {groups[i][1].line}", d.span))
        groups.setdefault(i, (d.devices, d.span))
    for i, (devs, span) in by_parts.items():
        if i not in groups:
            groups[i] = (tuple(devs), span)
        elif not set(devs) <= set(groups[i][0]):
            errors.add(StageAssignedTwice(
                f"parts of stage {st.name}[{i}] are assigned to devices {devs}, outside its "
                f"devices {list(groups[i][0])} (line {groups[i][1].line})", span,
                hint=f"assign the parts of {st.name}[{i}] to devices of its group"))
    for i in range(st.count):
        if i not in groups:
            errors.add(UnassignedStage(f"stage {st.name}[{i}] is not assigned to any device",
                                       st.span, hint=f"add 'assign {st.name}[{i}] to device N'"))
    errors.raise_if_any()
    return [groups[i][0] for i in range(st.count)]


def _part_prefix(sel: object) -> tuple[tuple[int, ...], object]:
    """``(index prefix, base)`` of ``part i of (part j of X)``; ``((), sel)`` for a plain one."""
    prefix: tuple[int, ...] = ()
    while isinstance(sel, PartOf):
        prefix, sel = prefix + sel.index, sel.base
    return prefix, sel


def _classes(groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The devices of the stage groups, grouped by the stages they run: each class is a
    pipeline rank, whose devices all run the same program.

    Stage groups that are equal or disjoint are their own classes (every pipeline before the
    interlaced one). Groups that overlap (the embedding on devices 0..4, stage 1 on device 0)
    split into the classes of devices that run the same stages: there a device's program holds
    the units of every stage whose group contains it, and a stage whose group holds several
    classes is *shared* by them (``StageGraph.hosts``).
    """
    member: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        for dev in g:
            member[dev].append(i)
    by_sig: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for dev in sorted(member):
        by_sig[tuple(member[dev])].append(dev)
    # a class that is a whole group keeps the group's device order (Lowered.groups did before)
    as_given = {frozenset(g): g for g in groups}
    classes = [as_given.get(frozenset(c), tuple(c)) for c in by_sig.values()]
    return sorted(classes, key=lambda c: (min(c), c))


def _unit(wu: WorkUnit, st: Stages, span: Span) -> Unit:
    sel = wu.selector
    if wu.pass_ not in _PASSES or not isinstance(sel, StageRef) or sel.group != st.name \
            or wu.mb is None:
        raise UnsupportedOrderUnit(
            f"cannot order '{wu}': pipeline order statements name a pass of a stage for a "
            f"micro-batch", span, hint=f"e.g. 'forward {st.name}[0] mb 0'")
    return Unit(sel.index, _PASSES[wu.pass_], wu.mb)


def _rank_of(groups: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    # Ranks (device classes) in order of first device, so a plain pipeline keeps rank == device.
    return {c: r for r, c in enumerate(_classes(groups))}


def _hosts(group: tuple[int, ...], rank: dict[tuple[int, ...], int]) -> tuple[int, ...]:
    """The ranks whose devices make up ``group``, in rank order."""
    return tuple(sorted(r for c, r in rank.items() if set(c) <= set(group)))


def lower_schedule(directives: Sequence[object], *,
                   edges: Iterable[tuple[int, int]] | None = None,
                   forward_only: Iterable[int] = ()) -> Lowered | None:
    """The schedule the directives describe, or ``None`` when the plan has no ``stages``.

    ``edges``: the stage DAG from the traced graph (default: a chain, stage i feeds i + 1);
    ``forward_only``: the stages without backward units (``StageGraph.forward_only``).
    The result is not checked yet: run ``ssdsl.check.check_schedule`` on ``.schedule``.
    """
    st = _stages(directives)
    if st is None:
        return None
    groups = _stage_groups(directives, st)
    rank = _rank_of(groups)
    hosts = [_hosts(g, rank) for g in groups]
    graph = StageGraph([h[0] for h in hosts],
                       edges if edges is not None else [(i, i + 1) for i in range(st.count - 1)],
                       forward_only, hosts=hosts)
    mbs = [d.count for d in directives if isinstance(d, Microbatch)]
    m = mbs[-1] if mbs else 1
    seqs, befores, origins = _orders(directives, st, rank, groups)
    split = any(u.kind in (Pass.I, Pass.W) for _, us in seqs.items() for u, _ in us) or \
        any(u.kind in (Pass.I, Pass.W) for b in befores for u in b[:2])
    programs = _programs(graph, m, split, seqs, befores, origins,
                         {r: c for c, r in rank.items()})
    schedule = Schedule(graph, m, programs, split)
    ordered = sorted(rank, key=rank.__getitem__)
    return Lowered(schedule, tuple(ordered), st.name)


_Before = tuple[Unit, Unit, Span]
# Where a stretch of a rank's sequence comes from: the ranks its statement orders (the
# statement's group: statements on one group concatenate into one chain), the statement's
# ordinal among the plan's directives and the number of units it adds.
_Origin = tuple[tuple[int, ...], int, int]


def _orders(directives: Sequence[object], st: Stages, rank: dict[tuple[int, ...], int],
            groups: list[tuple[int, ...]]
            ) -> tuple[dict[int, list[tuple[Unit, Span]]], list[_Before],
                       dict[int, list[_Origin]]]:
    seqs: dict[int, list[tuple[Unit, Span]]] = defaultdict(list)
    origins: dict[int, list[_Origin]] = defaultdict(list)
    befores: list[_Before] = []
    errors = ErrorCollector()
    # the one device of a group an `order on device d` named, per rank: all the group's devices
    # run that one program, so another of its devices cannot get an order of its own
    alone: dict[int, tuple[int, Span]] = {}
    group_of = {r: c for c, r in rank.items()}
    for ordinal, d in enumerate(directives):
        with errors.catch():
            if isinstance(d, OrderSequence):
                units = [(_unit(wu, st, d.span), d.span) for wu in d.units]
                ranks = _sequence_ranks(d, rank, groups)
                for r in ranks:
                    if len(d.devices) == 1 and len(group_of[r]) > 1:
                        dev, first = alone.setdefault(r, (d.devices[0], d.span))
                        if dev != d.devices[0]:
                            raise UnsupportedOrderUnit(
                                f"order on device {d.devices[0]}: devices "
                                f"{list(group_of[r])} run the same stages and so one program; "
                                f"device {dev} was given its order at line {first.line}",
                                d.span, hint=f"order them together: 'order on devices "
                                f"{list(group_of[r])}: ...', once")
                    seqs[r] += units
                    origins[r].append((ranks, ordinal, len(units)))
            elif isinstance(d, OrderBefore):
                befores.append((_unit(d.before, st, d.span), _unit(d.after, st, d.span), d.span))
    errors.raise_if_any()
    return seqs, befores, origins


def _sequence_ranks(d: OrderSequence, rank: dict[tuple[int, ...], int],
                    groups: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The ranks an ``order on devices G`` sequence joins: G's own rank, each rank of G when G is
    a stage's group made of several (a shared stage), or the rank of the one device G names."""
    # a group is a set of devices: `order on devices 2..4` names a stage on `devices [3, 2]`
    named = set(d.devices)
    same = [c for c in rank if set(c) == named]
    if same:
        return (rank[same[0]],)
    same = [g for g in groups if set(g) == named]
    if same:
        return _hosts(same[0], rank)
    owners = [g for g in rank if set(d.devices) <= set(g)]
    if len(owners) == 1 and len(d.devices) == 1:
        return (rank[owners[0]],)
    raise UnsupportedOrderUnit(
        f"order on devices {list(d.devices)}: no stage is assigned to exactly this device group",
        d.span, hint="order on the same devices a stage is assigned to")


def _programs(g: StageGraph, m: int, split: bool, seqs: dict[int, list[tuple[Unit, Span]]],
              befores: list[_Before], origins: dict[int, list[_Origin]],
              devices: dict[int, tuple[int, ...]]) -> list[Program]:
    timed = _interlace_by_time(g, split, seqs)
    merged = _merge_groups(g, split, seqs, befores, origins, devices) if timed is None else None
    if merged is not None:
        seqs = merged
    needs_auto = any(r not in seqs for r in range(g.num_devices))
    auto = _default_order(g, m, split, seqs, befores) if needs_auto else {}
    progs = []
    for r in range(g.num_devices):
        if r in seqs:
            seq = timed[r] if timed is not None else \
                merged[r] if merged is not None else _interlace(g, split, seqs[r])
            units, spans = zip(*seq) if seq else ((), ())
            progs.append(Program(r, units, spans))
        else:
            progs.append(Program(r, [u for u, _ in auto[r]], [s for _, s in auto[r]]))
    _check_befores(progs, befores)
    return progs


_TIME = {Pass.F: 1.0, Pass.B: 2.0, Pass.I: 1.0, Pass.W: 1.0}


def _interlace_by_time(g: StageGraph, split: bool, seqs: dict[int, list[tuple[Unit, Span]]]
                       ) -> dict[int, list[tuple[Unit, Span]]] | None:
    """Every rank's sequence with the units of shared stages put where they fall in time.

    The ranks' own units run in their order (F = 1, B = 2, I = W = 1), each when its data is
    there; a shared unit takes no time and happens when its inputs are there and the shared
    units before it (in each rank's shared order) have happened. On each rank a shared unit
    then runs right before the first own unit that starts at its time or later. So the head's
    forward of micro-batch k lands on the first stage's device among the forwards it runs while
    k reaches the last stage, not after its next backward. ``None`` when nothing is shared, or
    when the orders contradict each other (a cycle: ``_interlace`` then keeps each rank's own
    reading, and the checker reports the conflict at the statements).
    """
    if not any(g.shared(s) for s in range(g.num_stages)):
        return None
    own = {r: [(u, sp) for u, sp in seq if not g.shared(u.stage)] for r, seq in seqs.items()}
    shared = {r: [(u, sp) for u, sp in seq if g.shared(u.stage)] for r, seq in seqs.items()}
    if not any(own.values()) or not any(shared.values()):
        return None
    preds: dict[Unit, set[Unit]] = defaultdict(set)
    units: set[Unit] = set()
    for seq in list(own.values()) + list(shared.values()):
        units.update(u for u, _ in seq)
        for (a, _), (b, _) in zip(seq, seq[1:]):
            preds[b].add(a)
    for u in units:
        preds[u].update(d for d in data_deps(u, g, split_backward=split) if d in units)
    succ: dict[Unit, list[Unit]] = defaultdict(list)
    indeg = {u: len(preds[u]) for u in units}
    for b in units:
        for a in preds[b]:
            succ[a].append(b)
    ready = sorted(u for u in units if indeg[u] == 0)
    start: dict[Unit, float] = {}
    end: dict[Unit, float] = {}
    done = 0
    while ready:
        u = ready.pop()
        done += 1
        start[u] = max((end[a] for a in preds[u]), default=0.0)
        end[u] = start[u] + (0.0 if g.shared(u.stage) else _TIME[u.kind])
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    if done < len(units):
        return None
    out = {}
    for r, seq in seqs.items():
        keyed = [((start[u], 1, k), (u, sp)) for k, (u, sp) in enumerate(own[r])]
        keyed += [((start[u], 0, k), (u, sp)) for k, (u, sp) in enumerate(shared[r])]
        out[r] = [item for _, item in sorted(keyed, key=lambda x: x[0])]
    return out


def _interlace(g: StageGraph, split: bool, seq: list[tuple[Unit, Span]]
               ) -> list[tuple[Unit, Span]]:
    """A rank's sequence with the units of shared stages interlaced into those of its own.

    The shared units keep their order, the rank's own units theirs; each own unit runs right
    after the shared units it depends on (through any chain of data dependencies) have run,
    and the shared units left over run at the end. So the embedding's forward of micro-batch
    i runs on every device right before the forward that needs it, and its backward after the
    first stage's backward of i, wherever each device's own stages are in their schedule.
    """
    shared = [(u, sp) for u, sp in seq if g.shared(u.stage)]
    if not shared or len(shared) == len(seq):
        return seq
    pos = {u: k for k, (u, _) in enumerate(shared)}
    need: dict[Unit, int] = {}

    def last_needed(u: Unit) -> int:
        # The last position of a shared unit that u depends on, directly or not (-1: none).
        if u not in need:
            most = -1
            for dep in data_deps(u, g, split_backward=split):
                if dep in pos:
                    most = max(most, pos[dep])
                most = max(most, last_needed(dep))
            need[u] = most
        return need[u]

    out: list[tuple[Unit, Span]] = []
    done = 0
    for u, sp in seq:
        if g.shared(u.stage):
            continue
        upto = last_needed(u)
        out += shared[done:upto + 1]
        done = max(done, upto + 1)
        out.append((u, sp))
    return out + shared[done:]


def _merge_groups(g: StageGraph, split: bool, seqs: dict[int, list[tuple[Unit, Span]]],
                  befores: list[_Before], origins: dict[int, list[_Origin]],
                  devices: dict[int, tuple[int, ...]]
                  ) -> dict[int, list[tuple[Unit, Span]]] | None:
    """Every rank's sequence when a rank runs the orders of several device groups: stage 0 on
    devices 0..2 and stage 1 on devices 1..3 (each tensor-parallel), ordered by one statement
    per group, meet on device 1, which must run both statements' units in some interleaving.

    The interleaving is one topological order of all the ranks' units together: each group's
    statements (concatenated in plan order) keep their order, every data dependency and every
    ``a before b`` holds, and where these leave a choice the unit of the earlier statement (then
    the earlier position in it) comes first. Each rank runs this one order's units of its own,
    so the devices of a group all run the group's units in one order (its collectives cannot
    cross) and the programs cannot wait on each other in a cycle. ``None`` where no rank runs
    the orders of two groups (each rank's statements concatenate, as before), where a rank's
    sequence repeats a unit, or where the orders contradict each other between devices rather
    than on one device (the checker reports those at their statements). Raises
    ``OrderConflict`` where no interleaving exists on a device: the two statements (with the
    data dependencies) need each other's units in opposite orders.
    """
    if not any(len({o[0] for o in origins[r]}) > 1 for r in seqs):
        return None
    if any(len({u for u, _ in seq}) < len(seq) for seq in seqs.values()):
        return None
    prio: dict[Unit, tuple[int, int]] = {}
    # why each edge is there: (the group whose order has it, the spans of its two units),
    # "before" for a before edge, None for a data dependency (a group's order, where it also
    # has the edge, names it: its stretch then reads as the group's order in the error)
    why: dict[tuple[Unit, Unit], object] = {}
    for r, seq in seqs.items():
        chain: dict[tuple[int, ...], tuple[Unit, Span]] = {}
        each = [(key, ordinal, k) for key, ordinal, n in origins[r] for k in range(n)]
        for (u, sp), (key, ordinal, k) in zip(seq, each):
            prio[u] = min(prio.get(u, (ordinal, k)), (ordinal, k))
            if key in chain:
                why.setdefault((chain[key][0], u), (key, chain[key][1], sp))
            chain[key] = (u, sp)
    for a, b, span in befores:
        if a in prio and b in prio:
            why.setdefault((a, b), "before")
    for u in prio:
        for d in data_deps(u, g, split_backward=split):
            if d in prio:
                why.setdefault((d, u), None)
    succ: dict[Unit, list[Unit]] = defaultdict(list)
    indeg = {u: 0 for u in prio}
    for a, b in why:
        succ[a].append(b)
        indeg[b] += 1
    heap = [(prio[u], u) for u, n in indeg.items() if n == 0]
    heapq.heapify(heap)
    at: dict[Unit, int] = {}
    while heap:
        _, u = heapq.heappop(heap)
        at[u] = len(at)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (prio[v], v))
    if len(at) < len(prio):
        _raise_unmergeable({u for u in prio if u not in at}, why, devices)
        return None
    return {r: sorted(seq, key=lambda e: at[e[0]]) for r, seq in seqs.items()}


def _raise_unmergeable(left: set[Unit], why: dict[tuple[Unit, Unit], object],
                       devices: dict[int, tuple[int, ...]]) -> None:
    """Raise ``OrderConflict`` for a cycle among ``left`` through the orders of two or more
    device groups that meet on a device (no interleaving of them runs there); return when the
    cycle found is of another kind (one group's order against the data, devices that order a
    shared stage differently, a ``before`` statement), which the checker reports as before."""
    preds: dict[Unit, list[Unit]] = defaultdict(list)
    succ: dict[Unit, list[Unit]] = defaultdict(list)
    for a, b in why:
        if a in left and b in left:
            preds[b].append(a)
            succ[a].append(b)
    u, path = min(left), []
    while u not in path:
        path.append(u)
        u = min(preds[u])
    cycle = list(reversed(path[path.index(u):]))
    # the shortest cycle through a unit of the one found: the fewest units to read
    for start in sorted(cycle):
        shorter = _shortest_cycle(start, succ)
        if shorter and len(shorter) < len(cycle):
            cycle = shorter
    cycle.append(cycle[0])
    edges = list(zip(cycle, cycle[1:]))
    labels = [why[e] for e in edges]
    if "before" in labels:
        return
    keys = {lab[0] for lab in labels if isinstance(lab, tuple)}
    common = set.intersection(*(set(k) for k in keys)) if len(keys) > 1 else set()
    if not common:
        return
    # Rotate the cycle to start where a group's stretch of order edges begins, then cut it
    # into stretches (group, or None for data edges; units; spans of its units in order).
    k0 = next(i for i, lab in enumerate(labels)
              if isinstance(lab, tuple) and not (
                  isinstance(labels[i - 1], tuple) and labels[i - 1][0] == lab[0]))
    edges, labels = edges[k0:] + edges[:k0], labels[k0:] + labels[:k0]
    stretches: list[tuple[tuple[int, ...] | None, list[Unit], list[Span]]] = []
    for (a, b), lab in zip(edges, labels):
        key = lab[0] if isinstance(lab, tuple) else None
        if not stretches or stretches[-1][0] != key:
            stretches.append((key, [a], [lab[1]] if isinstance(lab, tuple) else []))
        stretches[-1][1].append(b)
        if isinstance(lab, tuple):
            stretches[-1][2].append(lab[2])
    ordered = [s for s in stretches if s[0] is not None]
    blamed = max(ordered, key=lambda s: (max(s[2]), -stretches.index(s)))
    span = max(blamed[2])
    x, y = blamed[1][0], blamed[1][-1]
    i = stretches.index(blamed)
    rest = [v for s in stretches[i + 1:] + stretches[:i] for v in s[1][1:]]
    through = " -> ".join(str(v) for v in [y] + rest)

    def runs(s: tuple[tuple[int, ...] | None, list[Unit], list[Span]]) -> str:
        first, last = s[2][0], s[2][-1]
        if first.line == last.line:
            return f"line {first.line} runs {s[1][0]} before {s[1][-1]}"
        return f"line {first.line} runs {s[1][0]} before line {last.line} runs {s[1][-1]}"

    def named(key: tuple[int, ...]) -> str:
        devs = sorted(d for r in key for d in devices[r])
        return f"device {devs[0]}" if len(devs) == 1 else f"devices {devs}"

    device = devices[min(common)][0]
    groups = " and ".join(named(k) for k in sorted(keys))
    others = [s for s in ordered if s is not blamed]
    if blamed[2][0].line == span.line:
        mine, here = f"this statement runs {x} before {y}", "here"
    else:
        mine = (f"the order of {named(blamed[0])} runs {x} (line {blamed[2][0].line}) before "
                f"{y} (this statement)")
        here = f"in the order of {named(blamed[0])} (lines {blamed[2][0].line}-{span.line})"
    raise OrderConflict(
        f"device {device} runs the orders of {groups}, and no interleaving of them on it keeps "
        f"each order: {mine}, but {y} must run before {x} ({through}: data dependencies, and "
        f"{', '.join(runs(s) for s in others)})", span,
        hint=f"reorder the sequences so that the orders agree: run {y} before {x} {here}, "
             f"or " + " or ".join(f"{s[1][-1]} before {s[1][0]} at line {s[2][-1].line}"
                                  for s in others))


def _shortest_cycle(start: Unit, succ: dict[Unit, list[Unit]]) -> list[Unit]:
    """The units of a shortest cycle through ``start`` (breadth first; [] when none)."""
    parent: dict[Unit, Unit] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for a in frontier:
            for b in sorted(succ[a]):
                if b == start:
                    out = [a]
                    while out[-1] != start:
                        out.append(parent[out[-1]])
                    return out[::-1]
                if b not in parent:
                    parent[b] = a
                    nxt.append(b)
        frontier = nxt
    return []


def _check_befores(progs: list[Program], befores: list[_Before]) -> None:
    # A unit of a shared stage is in several programs: each of them must keep the order.
    pos = [{u: k for k, u in enumerate(p.units)} for p in progs]
    errors = ErrorCollector()
    for a, b, span in befores:
        for p, at in zip(progs, pos):
            if a in at and b in at and at[a] > at[b]:
                errors.add(OrderConflict(f"'{a} before {b}' contradicts the order on device "
                                         f"{p.device}, which runs {b} first", span))
                break
    errors.raise_if_any()


def _priority(u: Unit) -> tuple[int, int, int]:
    # GPipe-like where nothing else decides: forwards before backward passes, by micro-batch;
    # deeper stages first among backwards so gradients flow without waiting.
    kind = 0 if u.kind is Pass.F else 1
    return (kind, u.mb, u.stage if kind == 0 else -u.stage)


def _default_order(g: StageGraph, m: int, split: bool, seqs: dict[int, list[tuple[Unit, Span]]],
                   befores: list[_Before]) -> dict[int, list[tuple[Unit, Span | None]]]:
    """A topological order of every unit (data edges, before edges, given sequences), by priority;
    projected per rank. A cycle is an error at the ``before`` statements on it."""
    units = list(required_units(g, m, split_backward=split))
    succ: dict[Unit, list[Unit]] = defaultdict(list)
    indeg: dict[Unit, int] = {u: 0 for u in units}
    span_of: dict[Unit, Span | None] = {}

    def edge(a: Unit, b: Unit) -> None:
        if a in indeg and b in indeg:
            succ[a].append(b)
            indeg[b] += 1

    for u in units:
        for dep in data_deps(u, g, split_backward=split):
            edge(dep, u)
    for seq in seqs.values():
        for (a, _), (b, _) in zip(seq, seq[1:]):
            edge(a, b)
    for a, b, span in befores:
        edge(a, b)
        span_of.setdefault(a, span)
        span_of.setdefault(b, span)
    heap = [(_priority(u), u) for u in units if indeg[u] == 0]
    heapq.heapify(heap)
    out: dict[int, list[tuple[Unit, Span | None]]] = defaultdict(list)
    done = 0
    while heap:
        _, u = heapq.heappop(heap)
        done += 1
        for h in g.hosts[u.stage]:
            out[h].append((u, span_of.get(u)))
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (_priority(v), v))
    if done < len(units):
        left = sorted((u for u, n in indeg.items() if n > 0), key=_priority)
        _raise_cycle(set(left), succ, befores)
        # The cycle runs through order sequences only: the checker reports those, at their
        # statements; finish the default order so that it can.
        for u in left:
            for h in g.hosts[u.stage]:
                out[h].append((u, span_of.get(u)))
    return out


def _raise_cycle(left: set[Unit], succ: dict[Unit, list[Unit]], befores: list[_Before]) -> None:
    """Raise ``OrderConflict`` for a cycle among ``left`` that a ``before`` statement is on."""
    preds: dict[Unit, list[Unit]] = defaultdict(list)
    for a, vs in succ.items():
        for b in vs:
            if a in left and b in left:
                preds[b].append(a)
    # Every unit left still waits for a predecessor that is left: walking predecessors must
    # come back to a unit already seen, and the walk from there is a cycle.
    u, path = min(left), []
    while u not in path:
        path.append(u)
        u = min(preds[u])
    cycle = list(reversed(path[path.index(u):]))
    cycle.append(cycle[0])
    pairs = set(zip(cycle, cycle[1:]))
    spans = sorted({s for a, b, s in befores if (a, b) in pairs})
    if not spans:
        return
    text = " -> ".join(str(x) for x in cycle)
    also = f" (also line {', '.join(str(s.line) for s in spans[1:])})" if len(spans) > 1 else ""
    raise OrderConflict(f"order statements and data dependencies form a cycle: {text}", spans[0],
                        hint=f"remove or reverse one of the 'before' statements on the cycle{also}")
