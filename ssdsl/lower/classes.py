"""Lowering once per rank class: ranks whose programs differ only in rank-dependent values.

Many ranks of a large plan run the same program up to their peers: the 64 ranks of one stage of
a dp x tp x pp pipeline differ in the peers and process groups of their communication, the
message tags, the regions of the shards and batch rows they take, the part index of each local
call and the gradient buckets they are in, and in nothing else. ``rank_key`` describes
everything the lowering of a rank (``ssdsl.lower.build._RankLowering``) reads about that rank,
with those values (the *stamped* fields) left out, and the *pattern* of equal source regions
kept (two uses of one shard give one take). Ranks of equal keys form a class; one
representative is lowered, and each other member's program is the representative's with the
stamped fields taken from the member's own plan, at the same positions (``stamp_program``):

- a ``Comm``'s or ``LocalAdapter``'s steps: the member's share of the same adapter
  (``rank_view``), stamped with the same tag base;
- a take's region: the member's source use of the same (tensor, operator, slot, part position);
- a ``Call``'s part index and local call: the member's part at the same position;
- a gradient bucket (``ReduceBucket``, ``GatherBucket``): the member's bucket at the same
  position among the buckets it is in (ZeRO stage 3, whose bucket indices order the lowering's
  work, keeps them in the key instead: such ranks share a class only with equal buckets);
- the program's rank.

Why that is the direct lowering of the member: the lowering reads a rank's plan only through
the facts the key holds and the stamped fields; it copies the stamped fields into instructions
without looking inside them (it only asks a step whether it moves data, and a take's region
whether it equals another: both in the key). So with equal keys it makes the same decisions at
the same places, and only the copied values differ. ``lower_rank(..., direct=True)`` lowers
directly, and the tests compare the two rank by rank, field by field, on many plans.

Every rank still has its own frozen program, checked as a whole by ``ssdsl.check``.
"""

from __future__ import annotations

from typing import Any

import attrs

from ssdsl.lower.instr import (Call, Coll, Comm, GatherBucket, LocalAdapter, LossSum, Program,
                               ReduceBucket, TakeBuffer, TakeInput, TakeParam)
from ssdsl.lower.build import _Context, _has_grad, _local_coll, stamp
from ssdsl.materialize.steps import PointToPoint

# -- the class key -------------------------------------------------------------------------------


@attrs.define
class RankIndex:
    """Per-rank lookups of a plan, made once (what each rank's key asks for)."""

    ops_on: dict[int, list[tuple[Any, tuple[Any, ...]]]]   # rank -> [(op, its parts there)]
    edges_on: dict[int, list[int]]                          # rank -> edge ids its adapter spans
    buckets_on: dict[int, list[int]]                        # rank -> indices of its buckets
    unit_group: dict[int, int]                              # rank -> its schedule program
    bucket_facts: tuple[tuple, ...]                         # per bucket: what the key compares
    sources: frozenset[tuple[str, str, int]]                # (tensor, op, slot) of source uses
    adapters: dict[int, tuple[Any, AdapterIndex]] = attrs.Factory(dict)  # id -> (it, index)

    def adapter(self, ad: Any) -> AdapterIndex:
        """``ad``'s steps indexed by device (made once per adapter)."""
        found = self.adapters.get(id(ad))
        if found is None or found[0] is not ad:
            found = self.adapters[id(ad)] = (ad, AdapterIndex.of(ad))
        return found[1]

    @classmethod
    def of(cls, ctx: _Context) -> RankIndex:
        m, t = ctx.m, ctx.m.transformed
        ops_on: dict[int, list[tuple[Any, tuple[Any, ...]]]] = {}
        for op in t.graph.ops:
            seen: set[int] = set()
            for p in t.parts[op.name]:
                if p.device not in seen:
                    seen.add(p.device)
                    ops_on.setdefault(p.device, []).append((op, ctx.placed[(op.name, p.device)]))
        edges_on: dict[int, list[int]] = {}
        for eid, key in enumerate(ctx.edge_keys):
            for d in m.edges[key].adapter.devices:
                edges_on.setdefault(d, []).append(eid)
        for lst in edges_on.values():
            lst.sort()
        buckets = m.reducer.buckets
        buckets_on: dict[int, list[int]] = {}
        for i, b in enumerate(buckets):
            for d in dict.fromkeys(b.devices):
                buckets_on.setdefault(d, []).append(i)
        everyone = tuple(range(t.world))
        carrier = max((i for i, b in enumerate(buckets)
                       if tuple(b.devices) == everyone and b.zero < 2), default=None)
        facts = tuple((b.zero, b.span, b.keep, tuple(name for name, _ in b.entries),
                       i == carrier) for i, b in enumerate(buckets))
        groups: dict[int, int] = {}  # a rank runs the first program that names it
        for k, (group, _) in enumerate(ctx.units):
            for r in group:
                groups.setdefault(r, k)
        sources = frozenset((name, op.name, slot) for op in t.graph.ops
                            for slot, name in enumerate(op.inputs)
                            if (name, op.name, slot) not in m.edges)
        return cls(ops_on, edges_on, buckets_on, groups, facts, sources)


@attrs.define
class AdapterIndex:
    """An adapter's placements and steps indexed by device, so that each rank's share of it
    (``view``: what ``ssdsl.lower.build.rank_view`` gives) costs what the rank does, not what
    every rank does (a 4,096-rank adapter's steps list every rank's messages)."""

    producers: dict[int, tuple[Any, ...]]
    consumers: dict[int, tuple[Any, ...]]
    steps: tuple[tuple, ...]  # per step: ("coll", member -> Coll) or ("p2p", end, by device)
    still: bool  # no steps in either direction
    # per device, the local shapes of its producer and consumer regions (what the class key
    # compares; made once, not once per rank)
    shapes: dict[int, tuple[tuple, tuple]] = attrs.Factory(dict)

    @classmethod
    def of(cls, ad: Any) -> AdapterIndex:
        steps: list[tuple] = []
        n = 0
        for step in ad.steps:
            if isinstance(step, PointToPoint):
                by: dict[int, tuple[list, list, list]] = {}
                for d, r in step.sources:
                    by.setdefault(d, ([], [], []))[0].append(r)
                for d, r in step.targets:
                    by.setdefault(d, ([], [], []))[1].append(r)
                for i, msg in enumerate(step.messages, n):
                    if msg.src == msg.dst:
                        entry = (i, "copy", msg.src, msg.src_slot, msg.dst_slot, msg.region)
                        by.setdefault(msg.src, ([], [], []))[2].append(entry)
                        continue
                    by.setdefault(msg.src, ([], [], []))[2].append(
                        (i, "send", msg.dst, msg.src_slot, msg.dst_slot, msg.region))
                    by.setdefault(msg.dst, ([], [], []))[2].append(
                        (i, "recv", msg.src, msg.src_slot, msg.dst_slot, msg.region))
                n += len(step.messages)
                steps.append(("p2p", n, {d: (tuple(a), tuple(b), tuple(c))
                                         for d, (a, b, c) in by.items()}))
            else:
                member: dict[int, Any] = {}
                for g in step.groups:  # a rank's group is the first that holds it
                    coll = _local_coll(step, g)
                    for d in g:
                        member.setdefault(d, coll)
                steps.append(("coll", member))
        producers: dict[int, list] = {}
        consumers: dict[int, list] = {}
        for d, r in ad.producers:
            producers.setdefault(d, []).append(r)
        for d, r in ad.consumers:
            consumers.setdefault(d, []).append(r)
        still = not ad.steps and not (ad.backward is not None and ad.backward.steps)
        shapes = {d: (tuple(r.local_shape for r in producers.get(d, ())),
                      tuple(r.local_shape for r in consumers.get(d, ())))
                  for d in {*producers, *consumers}}
        return cls({d: tuple(v) for d, v in producers.items()},
                   {d: tuple(v) for d, v in consumers.items()}, tuple(steps), still, shapes)

    def view(self, rank: int) -> tuple[Any, ...]:
        """``rank_view(adapter, rank)``."""
        out: list[Any] = []
        for step in self.steps:
            if step[0] == "p2p":
                mine = step[2].get(rank)
                out.append((step[1], *mine) if mine is not None else (step[1], (), (), ()))
            else:
                coll = step[1].get(rank)
                if coll is not None:
                    out.append(coll)
        return tuple(out)

    def passthrough(self, rank: int) -> bool:
        """``ssdsl.lower.build._passthrough(adapter, rank)``."""
        mine = self.producers.get(rank, ())
        return self.still and len(mine) >= 1 and mine == self.consumers.get(rank, ())


def rank_key(ctx: _Context, index: RankIndex, rank: int, views: dict[int, Any]) -> tuple:
    """Everything the lowering of ``rank`` reads about it, stamped fields left out (module
    docstring). ``views`` receives the rank's share of each adapter (``id`` -> view), for
    stamping."""
    m = ctx.m
    key: list[Any] = [index.unit_group.get(rank)]
    buckets = index.buckets_on.get(rank, [])
    z3 = any(m.reducer.buckets[i].zero == 3 for i in buckets)
    z3_of = {e: i for i in buckets if m.reducer.buckets[i].zero == 3
             for e in m.reducer.buckets[i].entries} if z3 else None
    key.append(tuple(buckets) if z3 else tuple(index.bucket_facts[i] for i in buckets))
    regions: dict[Any, int] = {}  # numbered by first use: equal keys, equal patterns
    output = m.transformed.graph.output
    for op, held in index.ops_on.get(rank, ()):
        loss = output in op.outputs  # a loss part counts once: replica 0
        key.append((op.name, tuple((tuple(x is None for x in p.sub.inputs), p.span,
                                    p.assigned_at, loss and any(p.replica_index))
                                   for p in held)))
        for slot, name in enumerate(op.inputs):
            if (name, op.name, slot) not in index.sources:
                continue
            for p in held:
                if p.sub.inputs[slot] is None:
                    continue
                use = m.sources.get((name, op.name, slot, rank, p.index))
                if use is None:
                    key.append(None)
                    continue
                n = regions.setdefault(use.region, len(regions))
                key.append((n, use.scale, z3_of.get((name, use.region)) if z3 else None))
    stage_devices, stage = ctx.stage_devices, m.transformed.stage
    for eid in index.edges_on.get(rank, ()):
        k = ctx.edge_keys[eid]
        ad = m.edges[k].adapter
        at = index.adapter(ad)
        fwd = views[id(ad)] = at.view(rank)
        back = None
        if ad.backward is not None:
            back = views[id(ad.backward)] = index.adapter(ad.backward).view(rank)
        mine, took = at.shapes.get(rank, ((), ()))
        key.append((eid, rank in stage_devices[stage(k[1])], at.passthrough(rank),
                    len(mine), len(took), mine, took, _shape_of(fwd),
                    _shape_of(back) if back is not None else None))
    return tuple(key)


def _shape_of(view: Any) -> tuple:
    """What the lowering asks of a rank's share of an adapter: per step, a collective's kind,
    whether it meets, its dims; a point-to-point step's extent, slot counts and messages' kinds
    (whether anything moves, whether the step is empty)."""
    out = []
    for step in view:
        if type(step) is tuple:
            end, sources, targets, msgs = step
            out.append((end, len(sources), len(targets), tuple(x[1] for x in msgs)))
        else:
            out.append((step.kind, step.meets, step.dim, step.cat_dim, step.split_dim))
    return tuple(out)


# -- stamping ------------------------------------------------------------------------------------


@attrs.frozen
class Representative:
    """A lowered representative of a class: its rank, program and where each instruction's
    stamped fields came from (``_RankLowering.sites``)."""

    rank: int
    program: Program
    sites: dict[int, tuple]
    buckets: tuple[int, ...]
    # the places a member may stamp, by what decides their values (``_Stamped``)
    stamped: _Stamped = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "stamped", _Stamped.of(self.program, self.sites))


@attrs.frozen
class _Stamped:
    """The positions of a representative's program that a member may stamp, grouped by what
    decides the stamped values, so that a member looks each up once: a call's part (every
    micro-batch's call of it), a take's source use, a comm's or local adapter's rank view; and
    the loss sums and gradient buckets. The others are every member's as they are."""

    calls: tuple[tuple[str, int, tuple[int, ...]], ...]          # (op, part position, places)
    takes: tuple[tuple[tuple, tuple[int, ...]], ...]              # (take site, places)
    comms: tuple[tuple[Any, tuple[tuple[int, int], ...]], ...]    # (adapter, (place, tag))
    locals_: tuple[tuple[int, tuple], ...]                        # (place, local site)
    rest: tuple[int, ...]                                         # loss sums and buckets

    @classmethod
    def of(cls, program: Program, sites: dict[int, tuple]) -> _Stamped:
        calls: dict[tuple, list[int]] = {}
        takes: dict[tuple, list[int]] = {}
        comms: dict[int, tuple[Any, list]] = {}
        locals_, rest = [], []
        for i, ins in enumerate(program.instructions):
            site = sites.get(id(ins))
            if site is None:
                if type(ins) is LossSum or type(ins) in _BUCKETS:
                    rest.append(i)
                continue
            kind = site[0]
            if kind == "call":  # the same part and call in every micro-batch: one group
                calls.setdefault((ins.op, site[1], ins.part, id(ins.call)), []).append(i)
            elif kind == "take":
                takes.setdefault(site[1:], []).append(i)
            elif kind == "comm":
                comms.setdefault(id(site[1]), (site[1], []))[1].append((i, site[2]))
            else:
                locals_.append((i, site))
        return cls(tuple((k[0], k[1], tuple(v)) for k, v in calls.items()),
                   tuple((k, tuple(v)) for k, v in takes.items()),
                   tuple((ad, tuple(v)) for ad, v in comms.values()),
                   tuple(locals_), tuple(rest))


def stamp_program(ctx: _Context, index: RankIndex, rep: Representative, rank: int,
                  views: dict[int, Any]) -> Program:
    """``rep``'s program with the stamped fields of ``rank`` (module docstring); ``views`` as
    ``rank_key`` filled them."""
    m = ctx.m
    placed, sources, stride = ctx.placed, m.sources, ctx.stride
    base = rep.program.instructions
    out = list(base)
    at = rep.stamped
    # the instructions are remade by their constructors, not ``attrs.evolve`` (a 1,024-rank
    # plan stamps millions); the tests compare every field with the direct lowering
    for op, pos, places in at.calls:
        part = placed[(op, rank)][pos]
        first = base[places[0]]
        at_part, local = part.index, part.sub.local
        if at_part != first.part or local is not first.call:
            for i in places:
                ins = base[i]
                out[i] = Call(op, at_part, ins.outs, ins.ins, local, ins.listy, ins.loss,
                              ins.count, span=ins.span)
    for (name, op, slot, pos), places in at.takes:
        part = placed[(op, rank)][pos]
        region = sources[(name, op, slot, rank, part.index)].region
        for i in places:
            if region != base[i].region:
                out[i] = _retake(base[i], region)
    for ad, places in at.comms:
        view = views[id(ad)]
        # collectives alone: the rank's view as it is (no tags to stamp), one tuple for every
        # micro-batch
        colls = all(type(x) is Coll for x in view)
        for i, tag in places:
            ins = base[i]
            steps = view if colls else stamp(view, tag, stride)
            if steps != ins.steps:
                out[i] = Comm(ins.edge, ins.mb, ins.backward, ins.ins, ins.outs, ins.shapes,
                              ins.dtype, steps, ins.grad, span=ins.span)
    for i, site in at.locals_:
        ins, ad = base[i], site[1]
        fwd = stamp(views[id(ad)], site[2], stride)
        back = stamp(views[id(ad.backward)], site[2] + 1, stride) if _has_grad(ad) else ()
        if fwd != ins.steps or back != ins.back:
            out[i] = LocalAdapter(ins.edge, ins.ins, ins.outs, fwd, back, span=ins.span)
    if at.rest:
        mine = index.buckets_on.get(rank, [])
        bucket_of = dict(zip(rep.buckets, mine))
        buckets = m.reducer.buckets
        for i in at.rest:
            ins = base[i]
            if type(ins) is LossSum:
                if ins.group == (rep.program.rank,) and rank != rep.program.rank:
                    out[i] = LossSum((rank,), span=ins.span)  # a rank's own loss: itself alone
            elif bucket_of.get(ins.bucket, ins.bucket) != ins.bucket:
                b = bucket_of[ins.bucket]
                out[i] = attrs.evolve(ins, bucket=b, group=tuple(buckets[b].devices),
                                      entries=tuple(buckets[b].entries))
    return Program(rank, rep.program.world, tuple(out))


_BUCKETS = (ReduceBucket, GatherBucket)


def _retake(ins: Any, region: Any) -> Any:
    """Take ``ins`` with ``region`` instead."""
    cls = type(ins)
    if cls is TakeParam:
        return TakeParam(ins.out, ins.tensor, region, ins.scale, span=ins.span)
    if cls is TakeInput:
        return TakeInput(ins.out, ins.index, ins.box, region, span=ins.span)
    if cls is TakeBuffer:
        return TakeBuffer(ins.out, ins.tensor, region, span=ins.span)
    return attrs.evolve(ins, region=region)


# -- the driver ----------------------------------------------------------------------------------


class ClassLowering:
    """The programs of one plan's ranks, each class lowered once (module docstring)."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        self.index = RankIndex.of(ctx)
        self.reps: dict[tuple, Representative] = {}
        self.rep_of: dict[int, int] = {}  # rank -> its representative, once asked

    def representative(self, rank: int) -> Program:
        """The program of ``rank``'s class representative (lowered once): what a reader of the
        program's shape alone (``ssdsl.cost``) needs, without stamping ``rank``'s own."""
        key = rank_key(self.ctx, self.index, rank, {})
        if key not in self.reps:
            self.program(rank)
        return self.reps[key].program

    def program(self, rank: int) -> Program:
        """The program of ``rank``: lowered if it is the first of its class, else stamped."""
        from ssdsl.lower.build import _RankLowering
        views: dict[int, Any] = {}
        key = rank_key(self.ctx, self.index, rank, views)
        rep = self.reps.get(key)
        if rep is not None:
            self.rep_of[rank] = rep.rank
            return stamp_program(self.ctx, self.index, rep, rank, views)
        self.rep_of[rank] = rank
        lowering = _RankLowering(self.ctx, rank)
        program = lowering.program()
        self.reps[key] = Representative(rank, program, lowering.sites,
                                        tuple(self.index.buckets_on.get(rank, ())))
        return program
