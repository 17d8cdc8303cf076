"""Units of work and per-device programs: the values every scheduling and checking step shares.

A *unit* is one pass of one stage for one micro-batch. Its compact text form is the one
``torch.distributed.pipelining`` prints, ``{stage}{pass}{microbatch}``: ``2F3`` is the forward of
stage 2 on micro-batch 3, ``0B7`` the backward of stage 0 on micro-batch 7. ``I`` (input gradient)
and ``W`` (weight gradient) are the two halves of a split backward (zero-bubble schedules).

A *program* is the ordered tuple of units one device runs, each with the ``Span`` of the plan
statement that put it there (``None`` for units a builder made). A ``Schedule`` bundles the stage
DAG (which stage feeds which, skip edges allowed), the stage to device map (a device may host
several stages: interleaved pipelines) and one program per device.

Example::

    >>> u = Unit.parse("2F3")
    >>> (u.kind, u.stage, u.mb, str(u))
    (<Pass.F: 'F'>, 2, 3, '2F3')
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence

import attrs

from ssdsl.source import Span


class Pass(enum.Enum):
    """The pass a unit runs. ``B`` is a whole backward; ``I`` and ``W`` split it in two."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the standard letter for the input-gradient half
    W = "W"

    # Members are singletons compared by identity: the C-level identity hash is consistent with
    # that and several times faster than Enum's, which schedules of 10^5 units notice.
    __hash__ = object.__hash__


_UNIT_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@attrs.frozen(order=True, cache_hash=True)
class Unit:
    """One pass of one stage on one micro-batch; orders by (stage, kind, mb) only for determinism."""

    stage: int
    kind: Pass = attrs.field(order=lambda p: "FBIW".index(p.value))
    mb: int = 0

    @classmethod
    def parse(cls, text: str) -> Unit:
        """Read the compact form ``{stage}{F|B|I|W}{mb}`` (``1B0``)."""
        m = _UNIT_RE.match(text.strip())
        if m is None:
            raise ValueError(f"not a unit: {text!r} (expected e.g. '1F0': stage, pass, micro-batch)")
        return cls(int(m.group(1)), Pass(m.group(2)), int(m.group(3)))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"


def F(stage: int, mb: int) -> Unit:  # noqa: N802 - reads like the notation F(s, m)
    """The forward unit of ``stage`` on micro-batch ``mb``."""
    return Unit(stage, Pass.F, mb)


def B(stage: int, mb: int) -> Unit:  # noqa: N802
    """The (whole) backward unit of ``stage`` on micro-batch ``mb``."""
    return Unit(stage, Pass.B, mb)


def _spans_like_units(instance: Program, attribute: attrs.Attribute, value: tuple) -> None:
    if len(value) != len(instance.units):
        raise ValueError(f"program of device {instance.device}: {len(instance.units)} units "
                         f"but {len(value)} spans")


@attrs.frozen
class Program:
    """The units one device runs, in order, each with the span of the statement that placed it."""

    device: int
    units: tuple[Unit, ...] = attrs.field(converter=tuple)
    spans: tuple[Span | None, ...] = attrs.field(converter=tuple, validator=_spans_like_units)

    @classmethod
    def of(cls, device: int, units: Iterable[Unit], span: Span | None = None) -> Program:
        """A program whose units all come from one statement (or from none)."""
        units = tuple(units)
        return cls(device, units, (span,) * len(units))

    @classmethod
    def parse(cls, device: int, text: str, span: Span | None = None) -> Program:
        """Read a program from its text form, units separated by spaces: ``'0F0 0F1 0B0 0B1'``."""
        return cls.of(device, (Unit.parse(t) for t in text.split()), span)

    def span_of(self, index: int) -> Span | None:
        return self.spans[index]

    def __len__(self) -> int:
        return len(self.units)

    def __str__(self) -> str:
        return " ".join(str(u) for u in self.units)


def _chain(n: int) -> tuple[tuple[int, int], ...]:
    return tuple((s, s + 1) for s in range(n - 1))


@attrs.frozen
class StageGraph:
    """Stages, the data edges between them (src feeds dst) and the device that hosts each stage.

    Edges must go forward (``src < dst``): stages are contiguous segments of a traced graph, in
    topological order, so stage 0 may feed stage 2 directly (a skip connection) but never back.

    ``forward_only`` stages have no backward units: nothing they compute is differentiated by
    the loss (the trunk passes of a recycling model before the last, whose output is detached).
    They run their forwards without keeping activations; their successors send them nothing back.

    ``hosts[s]`` are the devices that run stage s's units (default: ``(devices[s],)``). A stage
    with several hosts is *shared* (the interlaced pipeline's embedding and head, tensor-parallel
    over the devices of several other stages): each host runs every unit of the stage, and the
    hosts meet in it (its collectives), so they must order its units alike. ``devices[s]`` is
    then the first host, the one that sends the stage's results to devices outside it.
    """

    devices: tuple[int, ...] = attrs.field(converter=tuple)
    edges: tuple[tuple[int, int], ...] = attrs.field(
        converter=lambda es: tuple(sorted({(int(a), int(b)) for a, b in es})))
    forward_only: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    hosts: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, kw_only=True, repr=False,
        converter=lambda hs: None if hs is None else tuple(tuple(h) for h in hs))
    # Adjacency, derived once: schedules ask for it per unit, hundreds of thousands of times.
    _preds: tuple[tuple[int, ...], ...] = attrs.field(init=False, eq=False, repr=False)
    _succs: tuple[tuple[int, ...], ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if any(not 0 <= s < self.num_stages for s in self.forward_only):
            raise ValueError(f"forward-only stages {sorted(self.forward_only)} must exist "
                             f"(0..{self.num_stages - 1})")
        for src, dst in self.edges:
            if not 0 <= src < dst < self.num_stages:
                raise ValueError(f"stage edge {src}->{dst} must go forward between existing stages "
                                 f"(0..{self.num_stages - 1})")
        n = self.num_stages
        if self.hosts is None:
            object.__setattr__(self, "hosts", tuple((d,) for d in self.devices))
        elif len(self.hosts) != n or any(not h or h[0] != d
                                         for h, d in zip(self.hosts, self.devices)):
            raise ValueError(f"hosts {self.hosts} must list each stage's devices, its device "
                             f"{self.devices} first")
        object.__setattr__(self, "_preds", tuple(tuple(a for a, b in self.edges if b == s)
                                                 for s in range(n)))
        object.__setattr__(self, "_succs", tuple(tuple(b for a, b in self.edges if a == s)
                                                 for s in range(n)))

    @classmethod
    def chain(cls, devices: Sequence[int], forward_only: Iterable[int] = ()) -> StageGraph:
        """Stages in a line, ``stage s`` feeding ``s + 1``, stage s on ``devices[s]``."""
        return cls(devices, _chain(len(devices)), forward_only)

    def has_backward(self, stage: int) -> bool:
        """Whether ``stage`` runs backward units (it is not ``forward_only``)."""
        return stage not in self.forward_only

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @property
    def num_devices(self) -> int:
        return max(max(h) for h in self.hosts) + 1 if self.devices else 0

    def shared(self, stage: int) -> bool:
        """Whether several devices run ``stage``'s units together (``hosts``)."""
        return len(self.hosts[stage]) > 1

    def runs(self, stage: int, device: int) -> bool:
        """Whether ``device`` runs ``stage``'s units."""
        return device in self.hosts[stage]

    def preds(self, stage: int) -> tuple[int, ...]:
        """The stages whose outputs ``stage`` reads, in increasing order."""
        return self._preds[stage]

    def succs(self, stage: int) -> tuple[int, ...]:
        """The stages that read the outputs of ``stage``, in increasing order."""
        return self._succs[stage]

    def stages_on(self, device: int) -> tuple[int, ...]:
        return tuple(s for s, h in enumerate(self.hosts) if device in h)


@attrs.frozen
class Schedule:
    """A complete pipeline schedule: the stage graph, the micro-batch count and one program per
    device (``programs[d].device == d``). ``split_backward`` says whether backwards are whole
    (``B``) or split into ``I`` and ``W``."""

    stages: StageGraph
    microbatches: int
    programs: tuple[Program, ...] = attrs.field(converter=tuple)
    split_backward: bool = False

    def __attrs_post_init__(self) -> None:
        for d, prog in enumerate(self.programs):
            if prog.device != d:
                raise ValueError(f"programs[{d}] is the program of device {prog.device}")

    @property
    def num_devices(self) -> int:
        return len(self.programs)

    def passes(self, stage: int | None = None) -> tuple[Pass, ...]:
        """The passes every stage (or ``stage``) runs for every micro-batch: a forward-only
        stage runs ``F`` alone."""
        if stage is not None and not self.stages.has_backward(stage):
            return (Pass.F,)
        return (Pass.F, Pass.I, Pass.W) if self.split_backward else (Pass.F, Pass.B)

    def text(self) -> str:
        """One line per device, ``d: units``; ``Schedule.parse`` reads it back."""
        return "\n".join(f"{p.device}: {p}" for p in self.programs)

    @classmethod
    def parse(cls, stages: StageGraph, microbatches: int, text: str, *,
              split_backward: bool = False) -> Schedule:
        """Read the form ``text()`` writes (one ``device: units`` line per device, in order)."""
        progs = []
        for line in text.strip().splitlines():
            head, _, body = line.partition(":")
            progs.append(Program.parse(int(head), body))
        return cls(stages, microbatches, progs, split_backward)
