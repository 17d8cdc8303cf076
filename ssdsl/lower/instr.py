"""The instructions of a per-rank program (phase 7, lower).

A rank's program is a flat tuple of these frozen values; nothing about what the rank does is
decided after lowering. Values are named by strings (``'h_0_add@1'``: tensor ``h_0_add`` of
micro-batch 1); every instruction names the values it reads and writes, so the checker can follow
data without running anything.

Forward instructions build an autograd graph that is *cut* at every communication point (each
``Comm`` output is a new leaf) and at every segment boundary (``Cut``); backward is explicit:
``Backward`` runs autograd over one segment, and backward ``Comm`` instructions move the
gradients between segments in a fixed order, so the order of backward communication is part of
the program, not autograd's choice.

Communication steps are *localized*: a ``Comm`` lists only what this rank does, each collective
with its group, each message with its peer and tag.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from ssdsl.ir.region import Region
from ssdsl.ops.core import LocalCall
from ssdsl.source import Span

# -- localized communication steps --------------------------------------------------------------

# collective kinds that move data between the members of a group (chunk and zero_split are local)
MOVING = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})


@attrs.frozen
class Coll:
    """One collective (or local group op: chunk, zero_split) this rank runs with ``group``."""

    kind: str
    group: tuple[int, ...]
    dim: int = 0
    cat_dim: int = 0
    split_dim: int = 0

    @property
    def meets(self) -> bool:
        """Whether the members must meet (it moves data): chunk and zero_split are local."""
        return self.kind in MOVING and len(self.group) > 1


# the largest tag a program's message may carry: gloo's tags are 32-bit, and the one above this
# is the runtime's own (``ssdsl.runtime.exchange``: the all-reduce by pairwise exchanges); the
# walk (``ssdsl.lower.walk``) refuses a send beyond it, so the checker sees it before a run
MAX_TAG = 2**31 - 2


@attrs.frozen
class Msg:
    """One message of a point-to-point step: ``send`` of ``region`` from source slot
    ``src_slot`` to ``peer``, ``recv`` of it from ``peer`` into target slot ``dst_slot``, or a
    local ``copy``. ``tag`` pairs a send with its receive."""

    kind: str  # "send" | "recv" | "copy"
    peer: int
    tag: int
    src_slot: int
    dst_slot: int
    region: Region


@attrs.frozen
class P2P:
    """This rank's part of a point-to-point step: its source and target slot regions and its
    messages (sends never block; receives are waited for before the step ends)."""

    sources: tuple[Region, ...]
    targets: tuple[Region, ...]
    msgs: tuple[Msg, ...]


LocalStep = Coll | P2P


def moves(steps: tuple[LocalStep, ...]) -> bool:
    """Whether ``steps`` exchange anything with another rank."""
    return any(s.meets if isinstance(s, Coll) else any(m.kind != "copy" for m in s.msgs)
               for s in steps)


# -- instructions -------------------------------------------------------------------------------


def _span() -> Any:
    return attrs.field(default=None, kw_only=True)


@attrs.frozen
class Begin:
    """Start of unit ``unit`` (``'0F1'``: stage 0, forward, micro-batch 1). ``grad`` False: a
    forward-only unit, run without recording autograd (until its ``End``)."""

    kind: ClassVar[str] = "begin"
    unit: str
    span: Span | None = _span()
    grad: bool = True


@attrs.frozen
class End:
    """End of unit ``unit``."""

    kind: ClassVar[str] = "end"
    unit: str
    span: Span | None = _span()


@attrs.frozen
class TakeInput:
    """``out`` = ``region`` of micro-batch box ``box`` (None: the whole) of batch input ``index``."""

    kind: ClassVar[str] = "input"
    out: str
    index: int
    box: Region | None
    region: Region
    span: Span | None = _span()


@attrs.frozen
class TakeParam:
    """``out`` = this rank's shard ``region`` of parameter ``tensor``; its gradient counts
    ``scale`` times (one replica's share)."""

    kind: ClassVar[str] = "param"
    out: str
    tensor: str
    region: Region
    scale: float = 1.0
    span: Span | None = _span()


@attrs.frozen
class TakeBuffer:
    """``out`` = this rank's ``region`` of a buffer or constant ``tensor`` (no gradient)."""

    kind: ClassVar[str] = "buffer"
    out: str
    tensor: str
    region: Region
    span: Span | None = _span()


@attrs.frozen
class Call:
    """``outs`` = the local ATen call ``call`` of part ``part`` of operator ``op`` on ``ins``
    (``None``: an input this part does not read). ``loss``: ``outs[0]`` is a loss part (a seed of
    backward); ``count``: it is counted once in the step's loss (not a replica)."""

    kind: ClassVar[str] = "call"
    op: str
    part: tuple[int, ...]
    outs: tuple[str, ...]
    ins: tuple[str | None, ...]
    call: LocalCall
    listy: bool = False
    loss: bool = False
    count: bool = False
    span: Span | None = _span()


@attrs.frozen
class Cut:
    """``out`` = a detached leaf copy of ``src`` (made in an earlier segment); after the backward
    of this segment, its gradient is added to ``src``'s. In a split backward a *weight cut*
    (``src`` a weight-side value of the same segment, read by one call) is a ``Cut`` too: its
    gradient is taken by ``BackwardWeight``."""

    kind: ClassVar[str] = "cut"
    out: str
    src: str
    span: Span | None = _span()


@attrs.frozen
class LocalAdapter:
    """Edge ``edge``'s adapter where this rank exchanges nothing with others, in either
    direction: ``outs`` from ``ins`` by ``steps``, differentiable (backward: ``back``)."""

    kind: ClassVar[str] = "local"
    edge: int
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    steps: tuple[LocalStep, ...]
    back: tuple[LocalStep, ...]
    span: Span | None = _span()


@attrs.frozen
class Comm:
    """This rank's steps of edge ``edge``'s adapter (``backward``: its gradient adapter) on
    micro-batch ``mb``. Forward: ``ins`` are values, ``outs`` new leaves (requiring a gradient when
    ``grad``). Backward: ``ins`` name the forward outputs whose gradients are sent (zeros when none
    arrived), ``outs`` the forward inputs whose gradients are received (added up). ``shapes`` are
    the local shapes of what ``ins`` hold."""

    kind: ClassVar[str] = "comm"
    edge: int
    mb: int
    backward: bool
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    steps: tuple[LocalStep, ...]
    grad: bool = False
    span: Span | None = _span()


@attrs.frozen
class Backward:
    """Autograd over one segment: from ``seeds`` (loss parts, gradient one) and ``roots`` (values
    whose gradient the table holds), then each ``(leaf, into)`` of ``collect`` adds the leaf's
    gradient to ``into``'s entry of the table.

    ``part`` walks the segment in two: ``"sent"`` computes the gradients of the ``collect``
    leaves alone (into the table as above) and keeps the graph and the roots' gradients;
    a later ``"rest"`` of the same segment walks it again from the same seeds and roots, into
    every other leaf (the weights), and collects nothing. Between them stands the
    communication that sends the collected gradients on (``"whole"``: one walk does all)."""

    kind: ClassVar[str] = "backward"
    seeds: tuple[str, ...]
    roots: tuple[str, ...]
    collect: tuple[tuple[str, str], ...]
    part: str = attrs.field(default="whole",
                            validator=attrs.validators.in_(("whole", "sent", "rest")))
    span: Span | None = _span()


@attrs.frozen
class BackwardInput:
    """The input-gradient half of a split backward over one segment (an ``I`` unit): autograd
    from ``seeds`` and ``roots`` (the segment's values that depend on what it received) to the
    leaves it received, ``inputs`` (cuts and communicated leaves, whose gradients accumulate), then
    ``collect`` as in ``Backward``. The gradients of ``keep`` (the outputs of calls that read a
    weight through a weight cut) are kept for the weight half; the graph is kept too.

    No weight gradient is computed here: the autograd graph reaches a weight only through a
    weight cut, which is not asked for, so its products are left to ``BackwardWeight``."""

    kind: ClassVar[str] = "backward_input"
    seeds: tuple[str, ...]
    roots: tuple[str, ...]
    inputs: tuple[str, ...]
    collect: tuple[tuple[str, str], ...]
    keep: tuple[str, ...]
    span: Span | None = _span()


@attrs.frozen
class BackwardWeight:
    """The weight-gradient half of a split backward over one segment (a ``W`` unit). For each
    ``(outs, cuts)`` of ``mixes`` (a call that reads weights through the weight cuts ``cuts``,
    ``(cut, weight value)`` pairs), the gradients of the cuts from the kept gradients of
    ``outs``; then autograd over the weight side of the segment, from those, from ``seeds`` and
    from ``roots`` (values that depend on weights only), into the parameters' gradients.
    ``inputs``: the mixing calls' other inputs (their activations), which a closed-form weight
    gradient reads (``ssdsl.runtime.wgrad``)."""

    kind: ClassVar[str] = "backward_weight"
    seeds: tuple[str, ...]
    roots: tuple[str, ...]
    mixes: tuple[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], ...]
    inputs: tuple[str, ...] = ()
    span: Span | None = _span()


@attrs.frozen
class RecomputeBegin:
    """The calls up to ``RecomputeEnd`` keep no activations: backward runs them again from
    ``ins``; ``outs`` are what later instructions read."""

    kind: ClassVar[str] = "recompute"
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    span: Span | None = _span()


@attrs.frozen
class RecomputeEnd:
    kind: ClassVar[str] = "end_recompute"
    span: Span | None = _span()


@attrs.frozen
class Free:
    """Drop ``values`` (a unit's activations after its backward)."""

    kind: ClassVar[str] = "free"
    values: tuple[str, ...]
    span: Span | None = _span()


@attrs.frozen
class WaitSends:
    """Wait for every send still in flight."""

    kind: ClassVar[str] = "wait_sends"
    span: Span | None = _span()


@attrs.frozen
class ReduceBucket:
    """All-reduce over ``group`` the gradients of ``entries`` (weight tensor, region), flattened.

    With ``loss``, the loss parts this rank counts ride in the same all-reduce (one element
    after the gradients): the step's loss, without a collective of its own (``LossSum``).

    Stage 3 (``zero`` 3) reduce-scatters like stage 2 but stands inside the backward unit, right
    after the last backward that reaches the bucket's weights (``FreeParams``).

    ``zero`` > 0: a ZeRO-sharded bucket. This rank owns chunk ``group.index(rank)`` of the flat
    bucket (``ssdsl.materialize.reducer.shard_range``) and the optimizer steps only that chunk.
    Stage 1 all-reduces the whole flat bucket and keeps it; stage 2 reduce-scatters it (padded
    to a multiple of the group size), keeps the chunk's gradient and frees the others; a
    ``GatherBucket`` after the optimizer step rebuilds the weights."""

    kind: ClassVar[str] = "reduce"
    bucket: int
    group: tuple[int, ...]
    entries: tuple[tuple[str, Region], ...]
    span: Span | None = _span()
    loss: bool = False
    zero: int = 0

    @property
    def collective(self) -> str:
        """The collective this bucket's gradients travel in."""
        return "reduce_scatter" if self.zero >= 2 else "all_reduce"


@attrs.frozen
class GatherBucket:
    """After the optimizer step: all-gather over ``group`` the chunks of sharded bucket
    ``bucket`` that each member stepped, into the weights of ``entries`` on every member."""

    kind: ClassVar[str] = "gather"
    bucket: int
    group: tuple[int, ...]
    entries: tuple[tuple[str, Region], ...]
    span: Span | None = _span()


@attrs.frozen
class GatherParams:
    """ZeRO stage 3: start the all-gather over ``group`` of every member's chunk of bucket
    ``bucket`` into its flat buffer, whose views are the weights of ``entries``. It may still be
    in flight (a prefetch) until ``WaitParams``; the weights are read only after that."""

    kind: ClassVar[str] = "gather_params"
    bucket: int
    group: tuple[int, ...]
    entries: tuple[tuple[str, Region], ...]
    span: Span | None = _span()


@attrs.frozen
class WaitParams:
    """ZeRO stage 3: the gathered weights of ``bucket`` are read from here on (wait for the
    all-gather that ``GatherParams`` started)."""

    kind: ClassVar[str] = "wait_params"
    bucket: int
    span: Span | None = _span()


@attrs.frozen
class FreeParams:
    """ZeRO stage 3: release the flat buffer of ``bucket`` (only this rank's chunk of it stays);
    nothing reads its weights until the next ``GatherParams``."""

    kind: ClassVar[str] = "free_params"
    bucket: int
    span: Span | None = _span()


@attrs.frozen
class LossSum:
    """All-reduce over ``group`` of the loss parts this rank counts: the step's loss. A group
    of this rank alone meets no one: every rank holds the whole loss and counts its own parts
    (``ssdsl.lower.build.own_loss``)."""

    kind: ClassVar[str] = "loss_sum"
    group: tuple[int, ...]
    span: Span | None = _span()


@attrs.frozen
class OptimizerStep:
    """Step the optimizer on this rank's shards (missing gradients count as zeros)."""

    kind: ClassVar[str] = "step"
    span: Span | None = _span()


Instr = (Begin | End | TakeInput | TakeParam | TakeBuffer | Call | Cut | LocalAdapter | Comm
         | Backward | BackwardInput | BackwardWeight | RecomputeBegin | RecomputeEnd | Free
         | WaitSends | ReduceBucket | LossSum | OptimizerStep | GatherBucket | GatherParams
         | WaitParams | FreeParams)

INSTRUCTIONS: tuple[type, ...] = (Begin, End, TakeInput, TakeParam, TakeBuffer, Call, Cut,
                                  LocalAdapter, Comm, Backward, BackwardInput, BackwardWeight,
                                  RecomputeBegin, RecomputeEnd, Free,
                                  WaitSends, ReduceBucket, LossSum, OptimizerStep, GatherBucket,
                                  GatherParams, WaitParams, FreeParams)
BY_KIND: dict[str, type] = {c.kind: c for c in INSTRUCTIONS}


def reads(ins: Any) -> tuple[str, ...]:
    """The values ``ins`` reads (for the checker and for recompute segments)."""
    return _rule(_READS, ins)(ins)


def writes(ins: Any) -> tuple[str, ...]:
    """The values ``ins`` defines."""
    return _rule(_WRITES, ins)(ins)


def _rule(rules: dict[type, Any], ins: Any) -> Any:
    """The rule of ``ins``'s class in ``rules``, or of its nearest base class there (a class
    of none: no values)."""
    rule = rules.get(type(ins))
    if rule is None:
        rule = next((rules[c] for c in type(ins).__mro__ if c in rules), _nothing)
        rules[type(ins)] = rule
    return rule


def _call_reads(ins: Call) -> tuple[str, ...]:
    return ins.ins if None not in ins.ins else tuple(x for x in ins.ins if x is not None)


def _backward_reads(ins: Backward) -> tuple[str, ...]:
    return ins.seeds + ins.roots + tuple(leaf for leaf, _ in ins.collect)


def _backward_input_reads(ins: BackwardInput) -> tuple[str, ...]:
    return (ins.seeds + ins.roots + ins.inputs + tuple(leaf for leaf, _ in ins.collect)
            + ins.keep)


def _backward_weight_reads(ins: BackwardWeight) -> tuple[str, ...]:
    return ins.seeds + ins.roots + tuple(v for outs, cuts in ins.mixes
                                         for v in (*outs, *(x for c in cuts for x in c))
                                         ) + ins.inputs


def _nothing(ins: Any) -> tuple[str, ...]:
    return ()


# ``reads`` and ``writes`` by class (``_rule``)
_READS: dict[type, Any] = {
    Call: _call_reads,
    LocalAdapter: lambda ins: ins.ins,
    Comm: lambda ins: () if ins.backward else ins.ins,
    Cut: lambda ins: (ins.src,),
    Backward: _backward_reads,
    BackwardInput: _backward_input_reads,
    BackwardWeight: _backward_weight_reads,
    RecomputeBegin: lambda ins: ins.ins,
    **{c: _nothing for c in (Begin, End, TakeInput, TakeParam, TakeBuffer, RecomputeEnd, Free,
                             WaitSends, ReduceBucket, LossSum, OptimizerStep, GatherBucket,
                             GatherParams, WaitParams, FreeParams)},
}
_WRITES: dict[type, Any] = {
    **{c: (lambda ins: (ins.out,)) for c in (TakeInput, TakeParam, TakeBuffer, Cut)},
    Call: lambda ins: ins.outs,
    LocalAdapter: lambda ins: ins.outs,
    Comm: lambda ins: () if ins.backward else ins.outs,
    **{c: _nothing for c in (Begin, End, Backward, BackwardInput, BackwardWeight,
                             RecomputeBegin, RecomputeEnd, Free, WaitSends, ReduceBucket,
                             LossSum, OptimizerStep, GatherBucket, GatherParams, WaitParams,
                             FreeParams)},
}


@attrs.frozen
class Program:
    """One rank's whole training step, in order."""

    rank: int
    world: int
    instructions: tuple[Any, ...]

    def __len__(self) -> int:
        return len(self.instructions)

    @property
    def units(self) -> tuple[str, ...]:
        """The units this rank runs, in order (``'0F1'``...)."""
        return tuple(i.unit for i in self.instructions if isinstance(i, Begin))
