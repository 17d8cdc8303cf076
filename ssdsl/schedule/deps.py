"""Data dependencies between units, derived from the stage DAG alone.

For micro-batch m (micro-batches never depend on each other; gradients are only accumulated):

- ``F(s, m)`` after ``F(p, m)`` for every predecessor stage p (its inputs);
- ``B(s, m)`` (or ``I(s, m)``) after ``F(s, m)`` (saved activations) and after the input-gradient
  unit (``B`` or ``I``) of every successor stage (the gradient of its outputs);
- ``W(s, m)`` after ``I(s, m)``: the weight gradients of the layers inside a stage need the output
  gradients that the input-gradient pass computes layer by layer.

A forward-only stage (``StageGraph.forward_only``) has no backward units, and no backward waits
for it: no gradient flows into it.

A dependency between units on two devices is a message: the producer's device sends, the
consumer's device receives (``messages``). A shared stage (``StageGraph.hosts``) runs on each of
its hosts: a host of the producer reads its own result, another device receives it from the
producer's first host.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from ssdsl.schedule.units import Pass, Schedule, StageGraph, Unit


def input_grad_pass(split_backward: bool) -> Pass:
    """The pass that produces the gradient a stage sends to its predecessors."""
    return Pass.I if split_backward else Pass.B


def data_deps(unit: Unit, stages: StageGraph, *, split_backward: bool = False) -> tuple[Unit, ...]:
    """The units ``unit`` directly depends on.

    >>> g = StageGraph.chain([0, 1, 2])
    >>> [str(u) for u in data_deps(Unit.parse("1B4"), g)]
    ['1F4', '2B4']
    """
    s, m = unit.stage, unit.mb
    grad = input_grad_pass(split_backward)
    if unit.kind is Pass.F:
        return tuple(Unit(p, Pass.F, m) for p in stages.preds(s))
    if unit.kind is Pass.W:
        return (Unit(s, Pass.I, m),)
    return (Unit(s, Pass.F, m),) + tuple(Unit(t, grad, m) for t in stages.succs(s)
                                         if stages.has_backward(t))


def required_units(stages: StageGraph, microbatches: int, *,
                   split_backward: bool = False) -> Iterator[Unit]:
    """Every unit a complete schedule must run exactly once."""
    passes = (Pass.F, Pass.I, Pass.W) if split_backward else (Pass.F, Pass.B)
    for s in range(stages.num_stages):
        for kind in passes if stages.has_backward(s) else (Pass.F,):
            for m in range(microbatches):
                yield Unit(s, kind, m)


@attrs.frozen(cache_hash=True)
class Message:
    """A tensor that ``src`` (a unit on device ``src_device``) sends to ``dst`` on ``dst_device``."""

    src: Unit
    dst: Unit
    src_device: int
    dst_device: int

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


def messages(schedule: Schedule) -> Iterator[Message]:
    """Every cross-device dependency of ``schedule``, as a message, in a fixed order."""
    g = schedule.stages
    for prog in schedule.programs:
        for unit in prog.units:
            for dep in data_deps(unit, g, split_backward=schedule.split_backward):
                if not g.runs(dep.stage, prog.device):
                    yield Message(dep, unit, g.devices[dep.stage], prog.device)
