"""The flat directive list: the interface from the plan language to the later phases.

Elaboration turns a plan into a tuple of these frozen values, in plan order, with parameters
bound, loops unrolled, ``use`` inlined and every expression evaluated. What cannot be known without
a traced graph stays symbolic: **selectors** (which operators a directive is about) are small
frozen trees resolved against the graph later (``ssdsl.transform``).

Vocabulary (fixed, as in the rest of the project): a *dim* is a tensor dimension name (``batch``,
``heads``, ``in``), an *axis* is a mesh axis (``dp``), a *part* is one sub-operator made by
partition or replicate, indexed by a tuple with one entry per partition/replicate that applied to
the operator, in plan order (nesting).

Every directive has a ``span``: the statement that made it, in the file it was written in (a
directive that came through ``use`` points into the used file). ``str(d)`` is a one-line readable
form (``ssdsl check`` prints it); ``d.to_json()`` a JSON-ready dict.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from ssdsl.source import Span

# ================================================================ selectors


@attrs.frozen
class IndexRange:
    """The half-open index range ``lo..hi`` inside a module path (``h.0..12`` = h.0 ... h.11)."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}"


Segment = str | int | IndexRange  # a name, "*" (one level), "**" (any levels), an index, a range


@attrs.frozen
class Path:
    """Operators whose module path matches: names, ``*``, ``**``, indices and index ranges."""

    segments: tuple[Segment, ...]

    def __str__(self) -> str:
        return ".".join(str(s) for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        segs = [{"lo": s.lo, "hi": s.hi} if isinstance(s, IndexRange) else s for s in self.segments]
        return {"type": "path", "segments": segs}


@attrs.frozen
class All:
    """Every operator of the graph."""

    def __str__(self) -> str:
        return "all"

    def to_json(self) -> dict[str, Any]:
        return {"type": "all"}


@attrs.frozen
class Rest:
    """Every operator not selected by the ``excluded`` selectors: the partition and replicate
    statements that came before ``rest`` in the same plan file (a used plan has its own rest)."""

    excluded: tuple[Selector, ...]

    def __str__(self) -> str:
        return "rest"

    def to_json(self) -> dict[str, Any]:
        return {"type": "rest", "excluded": [s.to_json() for s in self.excluded]}


@attrs.frozen
class Kind:
    """Operators of these kinds (``linear``, ``softmax``, ``sdpa``, ...; see ``ssdsl.ops``)."""

    kinds: tuple[str, ...]

    def __str__(self) -> str:
        return f"kind({', '.join(self.kinds)})"

    def to_json(self) -> dict[str, Any]:
        return {"type": "kind", "kinds": list(self.kinds)}


@attrs.frozen
class StageRef:
    """The operators of stage ``index`` of the stage group ``group`` (a ``stages`` directive)."""

    group: str
    index: int

    def __str__(self) -> str:
        return f"{self.group}[{self.index}]"

    def to_json(self) -> dict[str, Any]:
        return {"type": "stage", "group": self.group, "index": self.index}


@attrs.frozen
class PartOf:
    """The parts of the ``base`` operators whose part index starts with ``index``."""

    index: tuple[int, ...]
    base: Selector

    def __str__(self) -> str:
        idx = str(self.index[0]) if len(self.index) == 1 else f"({', '.join(map(str, self.index))})"
        return f"part {idx} of {_atom(self.base)}"

    def to_json(self) -> dict[str, Any]:
        return {"type": "part", "index": list(self.index), "base": self.base.to_json()}


@attrs.frozen
class Union:
    left: Selector
    right: Selector

    def __str__(self) -> str:
        return f"{_atom(self.left, Union, Intersect)} | {_atom(self.right, Intersect)}"

    def to_json(self) -> dict[str, Any]:
        return {"type": "union", "left": self.left.to_json(), "right": self.right.to_json()}


@attrs.frozen
class Intersect:
    left: Selector
    right: Selector

    def __str__(self) -> str:
        return f"{_atom(self.left, Intersect)} & {_atom(self.right)}"

    def to_json(self) -> dict[str, Any]:
        return {"type": "intersect", "left": self.left.to_json(), "right": self.right.to_json()}


@attrs.frozen
class Except:
    left: Selector
    right: Selector

    def __str__(self) -> str:
        return (f"{_atom(self.left, Union, Intersect)} except "
                f"{_atom(self.right, Union, Intersect)}")

    def to_json(self) -> dict[str, Any]:
        return {"type": "except", "left": self.left.to_json(), "right": self.right.to_json()}


Selector = Path | All | Rest | Kind | StageRef | PartOf | Union | Intersect | Except


def _atom(sel: Selector, *allowed: type) -> str:
    """``str(sel)``, parenthesized unless it is an atom or one of ``allowed``."""
    if isinstance(sel, (Union, Intersect, Except)) and not isinstance(sel, allowed):
        return f"({sel})"
    return str(sel)


# ================================================================ units of work

PASSES = ("forward", "backward", "input_grad", "weight_grad")


@attrs.frozen
class WorkUnit:
    """A unit of work for ``order``: a pass (``forward``, ``backward``, ``input_grad``,
    ``weight_grad``) of the selected operators (usually a stage) for micro-batch ``mb``, or, with
    ``pass_ == "op"``, the selected operators themselves (forward, whole batch; ``mb`` is None)."""

    pass_: str
    selector: Selector
    mb: int | None

    def __str__(self) -> str:
        if self.pass_ == "op":
            return str(self.selector)
        return f"{self.pass_} {self.selector} mb {self.mb}"

    def to_json(self) -> dict[str, Any]:
        return {"pass": self.pass_, "selector": self.selector.to_json(), "mb": self.mb}


# ================================================================ directives


def _devices(devices: tuple[int, ...]) -> str:
    if len(devices) == 1:
        return f"device {devices[0]}"
    if devices == tuple(range(devices[0], devices[0] + len(devices))):
        return f"devices {devices[0]}..{devices[-1] + 1}"
    return f"devices [{', '.join(map(str, devices))}]"


class _Directive:
    """Shared behaviour: ``kind`` names the directive in tables and JSON."""

    kind: ClassVar[str]
    span: Span

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for field in attrs.fields(type(self)):
            if field.name == "span":
                continue
            out[field.name] = _json(getattr(self, field.name))
        s = self.span
        out["span"] = {"file": s.file, "line": s.line, "column": s.column,
                       "end_line": s.end_line, "end_column": s.end_column}
        return out


def _json(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    return value


@attrs.frozen
class Partition(_Directive):
    """Split every selected operator (each of its existing parts) into ``parts`` sub-operators
    along ``dim``; a reduced dim gives partial sums. Adds one entry to the part index."""

    kind: ClassVar[str] = "partition"
    selector: Selector
    dim: str
    parts: int
    span: Span

    def __str__(self) -> str:
        return f"partition {self.selector} along {self.dim} into {self.parts}"


@attrs.frozen
class Replicate(_Directive):
    """Make ``copies`` identical copies of every selected operator (of each existing part);
    adds one entry to the part index."""

    kind: ClassVar[str] = "replicate"
    selector: Selector
    copies: int
    span: Span

    def __str__(self) -> str:
        return f"replicate {self.selector} into {self.copies}"


@attrs.frozen
class Assign(_Directive):
    """Place the selected parts on devices.

    One device: every selected part goes there. Several devices (a *spread*): the parts of each
    selected operator, in row-major order of their part index, go one per device; their number
    must equal ``len(devices)`` (checked against the graph). ``part i of X`` selects one part.
    """

    kind: ClassVar[str] = "assign"
    selector: Selector
    devices: tuple[int, ...]
    span: Span

    def __str__(self) -> str:
        verb = "to" if len(self.devices) == 1 else "spread over"
        return f"assign {self.selector} {verb} {_devices(self.devices)}"


@attrs.frozen
class OrderBefore(_Directive):
    """``before`` happens before ``after`` (on the device both run on)."""

    kind: ClassVar[str] = "order"
    before: WorkUnit
    after: WorkUnit
    span: Span

    def __str__(self) -> str:
        return f"order {self.before} before {self.after}"


@attrs.frozen
class OrderSequence(_Directive):
    """Each of ``devices`` runs ``units`` in this order. Several sequences for one device
    concatenate in plan order."""

    kind: ClassVar[str] = "sequence"
    devices: tuple[int, ...]
    units: tuple[WorkUnit, ...]
    span: Span

    def __str__(self) -> str:
        units = ", ".join(_short_unit(u) for u in self.units)
        return f"order on {_devices(self.devices)}: {units}"


def _short_unit(u: WorkUnit) -> str:
    if u.pass_ == "op":
        return str(u.selector)
    letter = {"forward": "F", "backward": "B", "input_grad": "I", "weight_grad": "W"}[u.pass_]
    return f"{letter}({u.selector},{u.mb})"


@attrs.frozen
class Microbatch(_Directive):
    """Split each step's batch along ``dim`` into ``count`` micro-batches run one after another;
    gradients are accumulated (a partition in time, not in space)."""

    kind: ClassVar[str] = "microbatch"
    dim: str
    count: int
    span: Span

    def __str__(self) -> str:
        return f"microbatch along {self.dim} into {self.count}"


@attrs.frozen
class Stages(_Directive):
    """Group the operators into ``count`` contiguous stages named ``name[0..count]``: balanced by
    cost when ``selectors`` is empty, else stage i is ``selectors[i]``. With ``over`` (``stages
    into N over calls of X``), the graph is first cut at the calls of the module(s) X names, and
    each call's stretch is balanced into N / calls stages: stage ``k * (N / calls) + s`` is stage
    s of call k. With ``splits`` (``stages A, B into N, C as st``), selector i's operators are
    balanced into ``splits[i]`` stages of their own (empty: one stage per selector)."""

    kind: ClassVar[str] = "stages"
    name: str
    count: int
    selectors: tuple[Selector, ...]
    span: Span
    over: Selector | None = None
    splits: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.selectors:
            splits = self.splits or (1,) * len(self.selectors)
            items = (f"{s} into {n}" if n != 1 else str(s)
                     for s, n in zip(self.selectors, splits))
            return f"stages {', '.join(items)} as {self.name}"
        over = f" over calls of {self.over}" if self.over is not None else ""
        return f"stages into {self.count}{over} as {self.name}"

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.over is None:  # the plain forms keep the JSON they always had
            out.pop("over")
        if not self.splits:
            out.pop("splits")
        return out


@attrs.frozen
class Recompute(_Directive):
    """Do not keep the activations of the selected operators; recompute them in backward."""

    kind: ClassVar[str] = "recompute"
    selector: Selector
    span: Span

    def __str__(self) -> str:
        return f"recompute {self.selector}"


ZERO_STAGES = (1, 2, 3)


@attrs.frozen
class Zero(_Directive):
    """Shard the optimizer state of the selected operators' weights over ``devices`` (ZeRO
    ``stage`` 1); stage 2 also keeps only a shard of their reduced gradients, stage 3 also of
    the weights themselves."""

    kind: ClassVar[str] = "zero"
    selector: Selector
    devices: tuple[int, ...]
    span: Span
    stage: int = attrs.field(default=1, kw_only=True)

    def __str__(self) -> str:
        return f"zero {self.selector} over {_devices(self.devices)} stage {self.stage}"


@attrs.frozen
class Mesh(_Directive):
    """A named grid of devices: ``axes`` are (axis, size) pairs, ``devices`` the ids in row-major
    order (the last axis varies fastest)."""

    kind: ClassVar[str] = "mesh"
    name: str
    axes: tuple[tuple[str, int], ...]
    devices: tuple[int, ...]
    span: Span

    def __str__(self) -> str:
        axes = ", ".join(f"{a}={n}" for a, n in self.axes)
        return f"mesh {self.name} = grid({axes}) on {_devices(self.devices)}"


Directive = (Partition | Replicate | Assign | OrderBefore | OrderSequence | Microbatch | Stages
             | Recompute | Zero | Mesh)


@attrs.frozen
class ElaboratedPlan:
    """The result of elaboration: the plan's bound parameters and its directives."""

    name: str
    file: str
    doc: str | None
    world: int
    params: tuple[tuple[str, Any], ...]
    directives: tuple[Directive, ...]

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.name, "file": self.file, "world": self.world,
                "params": {k: _json(v) for k, v in self.params},
                "directives": [d.to_json() for d in self.directives]}
