"""Where each rank runs each adapter in a pipeline, and which program of units it follows.

A data edge feeds operator C (stage b) from operator P (stage a). A rank of the edge's adapter
that holds parts of stage b runs the adapter inside ``F(b, k)``, at C, as in a plan of one stage:
the stage's devices all run the same program, so the collectives inside a stage line up. A rank
that only produces (it is not among stage b's devices) runs it inside ``F(a, k)`` right after P:
that is the send to a later stage, and its token is a root of ``B(a, k)``, whose backward
receives the gradient. A collective step needs all its members at the same point, so every group
of a collective must lie on one side; point-to-point steps may span both (sends never block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from ssdsl.ir.graph import Op
from ssdsl.materialize.program import Materialized, UnsupportedPlacement
from ssdsl.materialize.steps import Adapter, CollectiveStep, PointToPoint
from ssdsl.schedule.units import B, F, Unit

EdgeKey = tuple[str, str, int]


@attrs.frozen
class PipelineLayout:
    """Per stage its operators; per edge and rank whether the rank runs it at the consumer."""

    ops_of: dict[int, list[Op]]
    stage_devices: dict[int, frozenset[int]]
    at_consumer: dict[EdgeKey, dict[int, bool]]
    sends_after: dict[str, list[EdgeKey]]
    producer: dict[str, str]
    edge_ids: dict[EdgeKey, int]
    microbatches: int
    programs: tuple[tuple[tuple[int, ...], tuple[Unit, ...]], ...]  # (devices, units)
    consumers_of: dict[str, frozenset[str]]
    output: str

    @classmethod
    def of(cls, m: Materialized) -> PipelineLayout:
        t = m.transformed
        g = t.graph
        ops_of: dict[int, list[Op]] = {}
        devices: dict[int, set[int]] = {}
        for op in g.ops:
            s = t.stage(op.name)
            ops_of.setdefault(s, []).append(op)
            devices.setdefault(s, set()).update(p.device for p in t.parts[op.name])
        producer = {x: op.name for op in g.ops for x in op.outputs}
        at_consumer: dict[EdgeKey, dict[int, bool]] = {}
        sends_after: dict[str, list[EdgeKey]] = {}
        for key, edge in m.edges.items():
            b = t.stage(key[1])
            at_consumer[key] = {d: d in devices[b] for d in edge.adapter.devices}
            _check_sides(key, edge.adapter, at_consumer[key])
            sends_after.setdefault(producer[key[0]], []).append(key)
        consumers: dict[str, set[str]] = {}
        for op in g.ops:
            for x in op.inputs:
                consumers.setdefault(x, set()).add(op.name)
        return cls(ops_of, {s: frozenset(d) for s, d in devices.items()}, at_consumer,
                   sends_after, producer, {key: i for i, key in enumerate(m.edges)},
                   t.microbatches, _programs(m), {k: frozenset(v) for k, v in consumers.items()},
                   g.output)

    def tag(self, key: EdgeKey, mb: int) -> int:
        """The message tag of edge ``key`` on micro-batch ``mb`` (unique among all in flight)."""
        return self.edge_ids[key] * self.microbatches + mb

    def program_of(self, rank: int) -> tuple[Unit, ...]:
        """The units ``rank`` runs in one step, in order (none: it holds no stage)."""
        for group, units in self.programs:
            if rank in group:
                return units
        return ()

    def used_outside(self, ops: Sequence[Op], inside: set[str]) -> list[str]:
        """Tensors made by ``ops`` that other operators (or the loss) use, in order."""
        names = {op.name for op in ops}
        return [x for op in ops for x in op.outputs
                if x == self.output or self.consumers_of.get(x, frozenset()) - names]


def _programs(m: Materialized) -> tuple[tuple[tuple[int, ...], tuple[Unit, ...]], ...]:
    if m.schedule is not None:
        return tuple((group, prog.units)
                     for group, prog in zip(m.schedule.groups, m.schedule.schedule.programs))
    # No pipeline: every rank runs each micro-batch's forward then its backward.
    everyone = tuple(range(m.transformed.world))
    units = tuple(u for k in range(m.transformed.microbatches) for u in (F(0, k), B(0, k)))
    return ((everyone, units),)


def _steps(adapter: Adapter) -> Iterable:
    yield from adapter.steps
    if adapter.backward is not None:
        yield from adapter.backward.steps


def _check_sides(key: EdgeKey, adapter: Adapter, at_consumer: dict[int, bool]) -> None:
    for step in _steps(adapter):
        if not isinstance(step, CollectiveStep):
            continue
        for group in step.groups:
            if len({at_consumer.get(d, True) for d in group}) > 1:
                raise UnsupportedPlacement(
                    f"the data edge '{key[0]}' -> '{key[1]}' needs a {step.kind} among devices "
                    f"{list(group)}, which run it in different pipeline stages",
                    None, hint="place both stages' parts so that communication between stages is "
                    "point to point (different device groups)")


def _communicates(adapter: Adapter) -> bool:
    return any(isinstance(s, PointToPoint) or (isinstance(s, CollectiveStep) and s.nbytes)
               for s in _steps(adapter))


def recompute_ops(m: Materialized) -> frozenset[str]:
    """The operators ``recompute`` statements select, except those next to communication (a
    recomputed receive would receive twice); the same set on every rank."""
    t = m.transformed
    chosen = set(t.recompute)  # resolved and checked by the schedule phase
    if not chosen:
        return frozenset()
    producer = {x: op.name for op in t.graph.ops for x in op.outputs}
    for (tensor, op, _slot), edge in m.edges.items():
        if _communicates(edge.adapter):
            chosen.discard(op)
            chosen.discard(producer.get(tensor, ""))
    return frozenset(chosen)
