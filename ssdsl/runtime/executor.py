"""Running a rank's lowered program: the instruction handlers every backend shares.

``Runner`` handles every instruction that stays on the rank (taking inputs and shards, local
ATen calls, cuts, local adapters, backward segments, recompute, freeing, the optimizer). Where a
rank meets others (a collective, a receive, a send) it calls ``meet``/``meet_all``/``post``,
which a backend defines: ``DistRunner`` on torch.distributed here, ``SimRunner``
(``ssdsl.runtime.simulate``) by yielding to the in-process exchange. The walk itself is
``ssdsl.lower.walk.walk``: one walk, whatever the backend.

A forward ``comm`` makes its outputs new autograd leaves and ``backward`` runs autograd over one
segment between communication points, so no communication ever happens inside autograd: the
order of every collective and message, backward included, is the program's.

``RankProgram`` is one rank's trainer: its program (``ssdsl.lower.lower_rank``), its shards
(``init_state``; ``_init_state`` is the hook to initialise them otherwise), its optimizer, and
``train_batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch.autograd.graph import get_gradient_edge
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ssdsl.ir.graph import writes_in_place
from ssdsl.ir.interpret import call_target
from ssdsl.ir.region import Region
from ssdsl.lower import Handler, Program, Wait, lower_rank, walk
from ssdsl.lower.instr import BackwardInput, BackwardWeight, Coll, P2P
from ssdsl.materialize.program import Materialized
from ssdsl.runtime.comm import (coll_on_rank, isend, local_coll, start_all_gather_into,
                                start_reduce_scatter, wait_sends)
from ssdsl.runtime.early import EarlyRecv, early_receives
from ssdsl.runtime.early_loss import LossPlan, loss_plan
from ssdsl.runtime.flat import FlatGrads, flat_grads
from ssdsl.runtime.groups import ProcessGroups, groups_of
from ssdsl.runtime import exchange, hostmem, liveness
from ssdsl.runtime.init import init_shards
from ssdsl.runtime.liveness import dead_before_backwards, held_as_edges
from ssdsl.runtime.overlap import OverlapPlan, Parts, overlap_plan
from ssdsl.runtime.prebuilt import prebuild
from ssdsl.runtime.prologue import step_values_code
from ssdsl.runtime import sender as sending
from ssdsl.runtime import straight as straight_code
from ssdsl.runtime import wgrad
from ssdsl.runtime.reference import to_dtype
from ssdsl.runtime.slots import Slot, pieces, slot_of, slots_of
from ssdsl.runtime.train import OptimizerSpec, build_optimizer
from ssdsl.runtime.zero import ZeroShard, model_state_bytes, optimizer_params, zero_shards
from ssdsl.trace.model_file import ModelFile, ModelFileContract

try:  # the engine as ``torch.autograd.backward`` calls it, after its checks of the gradients
    from torch.autograd.graph import _engine_run_backward

    def _run_backward(tensors: list, grads: list) -> None:
        _engine_run_backward(tuple(tensors), tuple(grads), False, False, (),
                             allow_unreachable=True, accumulate_grad=True)
except ImportError:  # another torch: the public call
    def _run_backward(tensors: list, grads: list) -> None:
        torch.autograd.backward(tensors, grads)


# whether ``Runner`` runs calls and batch inputs through prebuilt closures (benchmarks compare)
PREBUILD = True
# whether ``Runner.run`` walks a program through its handlers looked up once per program (off:
# through ``walk`` and ``visit``, per instruction; benchmarks compare)
RUN_LOOP = True


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient is multiplied by ``scale`` (a replica's share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` whose gradient counts ``scale`` times (one replica's share of a weight's gradient)."""
    return _ScaleGrad.apply(x, scale) if scale != 1.0 else x


@attrs.define
class RankState:
    """This rank's shards of the parameters, keyed by (graph tensor name, region)."""

    leaves: dict[tuple[str, Region], torch.Tensor]
    fixed: dict[tuple[str, Region], torch.Tensor]


def init_state(m: Materialized, rank: int, model, *, dtype: torch.dtype | None = None
               ) -> RankState:
    """This rank's regions of the seeded single-device model's parameters and buffers, from a
    live model or a state file of it, without the full model (``ssdsl.runtime.init``); floats
    in ``dtype`` (default: the plan's)."""
    return RankState(*init_shards(m, rank, model, dtype=dtype))


def retyped(value: Any, retype: Mapping[torch.dtype, torch.dtype]) -> Any:
    """``value`` (a call's arguments) with every dtype in ``retype`` replaced: the traced dtype
    of a plan's floats becomes the dtype its programs run in (``Runner.retype``)."""
    if isinstance(value, torch.dtype):
        return retype.get(value, value)
    if isinstance(value, (tuple, list)):
        return type(value)(retyped(v, retype) for v in value)
    return value


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
           "bool": torch.bool}


def _dtype(name: str, run: torch.dtype) -> torch.dtype:
    """A program's dtype name; ``float`` is the run's floating dtype (chosen at run time)."""
    return run if name == "float" else _DTYPES.get(name) or getattr(torch, name)


class _LocalSteps(torch.autograd.Function):
    """A local adapter: ``steps`` forward, ``back`` backward, no other rank involved."""

    @staticmethod
    def forward(ctx, runner: Runner, ins: Any, like: torch.Tensor, *inputs: torch.Tensor):
        ctx.runner, ctx.ins, ctx.n = runner, ins, len(inputs)
        outs = runner.local_steps(ins.steps, list(inputs), like)
        ctx.shapes = [tuple(o.shape) for o in outs]
        ctx.like = like
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        held = [g if g is not None else ctx.like.new_zeros(s) for g, s in zip(grads, ctx.shapes)]
        res = ctx.runner.local_steps(ctx.ins.back, held, ctx.like)
        res = list(res) + [None] * (ctx.n - len(res))
        return (None, None, None, *res[:ctx.n])


def _whole_copies(step: P2P) -> set[int]:
    """Target slots that one message fills whole: one local copy of a whole source slot
    (co-shard's parts reading one replicated input), or one receive of the whole target (a
    pipeline stage's input). They take the source's storage or the receive buffer instead of
    a zeroed tensor that the piece is added into. Nothing writes into a value in place, and a
    receive buffer is this rank's alone, so sharing is safe."""
    count: dict[int, int] = {}  # messages into each of this rank's target slots
    for msg in step.msgs:
        if msg.kind != "send":
            count[msg.dst_slot] = count.get(msg.dst_slot, 0) + 1
    return {msg.dst_slot for msg in step.msgs
            if msg.kind != "send" and count[msg.dst_slot] == 1
            and _spatial(step.targets[msg.dst_slot]) == _spatial(msg.region)
            and (msg.kind == "recv"
                 or _spatial(msg.region) == _spatial(step.sources[msg.src_slot]))}


def _spatial(r: Region) -> tuple:
    return (r.shape, r.intervals)


def _without_grad(waits: Iterator[Wait]) -> Iterator[Wait]:
    """``waits`` run step by step under ``torch.no_grad()``."""
    while True:
        with torch.no_grad():
            try:
                w = next(waits)
            except StopIteration:
                return
        yield w


def take_index(ins: Any) -> tuple[torch.Size, tuple[slice, ...] | None]:
    """The shape of the batch input a ``TakeInput`` reads, and the index of slices that takes
    its rows (its micro-batch box, then its region inside the box) as a view: ``()`` for the
    whole input, None where either is not a box (``Region.slice_of`` then gathers them)."""
    box = ins.box
    inner = ins.region.box_index()
    if box is None:
        return torch.Size(ins.region.shape), inner
    outer = box.box_index()
    if inner is None or outer is None:
        return torch.Size(box.shape), None
    if not inner:
        return torch.Size(box.shape), outer
    outer = outer or tuple(slice(0, n) for n in box.shape)
    return torch.Size(box.shape), tuple(slice(o.start + i.start, o.start + i.stop)
                                        for o, i in zip(outer, inner))


def _once(cache: dict[int, tuple[Program, Any]], program: Program, make: Callable[[], Any]
          ) -> Any:
    """``make()`` for ``program``, kept in ``cache`` by the program's identity (the program is
    kept beside it, so a new program at a reused ``id`` is not taken for the old one)."""
    got = cache.get(id(program))
    if got is None or got[0] is not program:
        got = cache[id(program)] = (program, make())
    return got[1]


class Runner(Handler):
    """The instruction handlers of one rank; communication goes through ``meet``, ``meet_all``
    and ``post``, which each backend defines."""

    def __init__(self, rank: int, state: RankState, *, dtype: torch.dtype,
                 opt: torch.optim.Optimizer | None = None,
                 device: torch.device = torch.device("cpu"),
                 zero: dict[int, ZeroShard] | None = None,
                 retype: Mapping[torch.dtype, torch.dtype] | None = None) -> None:
        self.rank, self.state, self.dtype, self.opt, self.device = rank, state, dtype, opt, device
        # the dtypes named in calls (``full(..., dtype=float32)``, ``_to_copy``) that become
        # another: the plan traced in float32, run in float64 (verification before launch)
        self.retype = retype or None
        self.zero = zero or {}  # this rank's chunk of each ZeRO-sharded bucket
        self.env: dict[str, Any] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.kept: dict[str, torch.Tensor] = {}  # output gradients an I unit keeps for its W
        self.cut_grads: dict[str, torch.Tensor] = {}  # weight cuts' gradients an I unit made
        # the gradient edges of kept outputs dropped from ``env`` at their I unit (liveness)
        self.edges: dict[str, Any] = {}
        # the gradient edges of split backwards' places (a mixing call's output) taken just
        # before an in-place operator wrote them (``nn.ReLU(inplace=True)`` after a linear):
        # the tensor then stands for the in-place op's output, not the call's
        self.inplaced: dict[str, Any] = {}
        self._watched: frozenset[str] = frozenset()
        self._watched_of: dict[int, tuple[Program, frozenset[str]]] = {}
        self.batch: tuple[torch.Tensor, ...] = ()
        self.losses: list[tuple[torch.Tensor, bool]] = []
        self.loss_total: float | None = None
        self.peak_live = 0
        self._region: tuple[Any, list] | None = None
        self._replay = False
        self._frozen = False  # inside a forward-only unit
        self._prebuilt: dict[int, tuple[Any, Any]] = {}  # id(instruction) -> (it, handler)
        self._sequences: dict[int, tuple[Program, list]] = {}  # id(program) -> (it, steps)
        self._generated: dict[int, tuple[Program, Any]] = {}  # id(program) -> (it, its code)
        self._takes: dict[int, tuple] = {}  # id(TakeInput) -> (it, batch shape, index)
        self._leaves_of: dict[int, tuple[Any, RankState, list]] = {}  # id(bucket) -> leaves
        # id(bucket) -> its entries' slots where some entry is a slice of a leaf, else None
        self._slots_of: dict[int, tuple[Any, RankState, list[Slot] | None]] = {}
        # the values dropped from ``env`` before each backward that starts a walk (``liveness``)
        # of the program ``run`` walks, and of each program it walked
        self._dead: dict[int, tuple[Any, tuple[str, ...]]] = {}
        self._dead_of: dict[int, tuple[Program, dict]] = {}
        # the kept outputs each input half holds as gradient edges only (``liveness``), likewise
        self._edged: dict[int, tuple[Any, tuple[str, ...]]] = {}
        self._edged_of: dict[int, tuple[Program, dict]] = {}
        # each weight half's closed-form rules per mixing call (``runtime.wgrad``) of the program
        # being walked (``prepare``), and of each program prepared
        self._wrules: dict[int, tuple[Any, tuple]] = {}
        self._wrules_of: dict[int, tuple[Program, dict]] = {}
        self.closed_form = 0  # mixing calls whose weight gradient a rule gave (for tests)
        self.from_input_half = 0  # of those, the ones the input half gave (``wgrad.EARLY``)
        # the state and its leaves that ``on_step`` makes sure have a gradient
        self._stepped: tuple[RankState, list[torch.Tensor]] | None = None

    def start(self, batch: tuple[torch.Tensor, ...]) -> None:
        """A new step on the whole batch ``(*inputs, target)``."""
        self.batch = tuple(batch)
        self.env, self.grads, self.losses, self.loss_total = {}, {}, [], None
        self.kept, self.edges, self.cut_grads, self.inplaced = {}, {}, {}, {}
        # the optimizer clears the gradients of what it steps; the weights of a sharded bucket
        # are not among them (stage 1 keeps their whole gradient until here)
        for shard in self.zero.values():
            for e in shard.ins.entries:
                self.state.leaves[e].grad = None

    # -- backends -------------------------------------------------------------------------------
    def meet(self, w: Wait) -> Iterator[Wait]:
        raise NotImplementedError

    def meet_all(self, ws: list[Wait]) -> Iterator[Wait]:
        for w in ws:
            yield from self.meet(w)

    def post(self, msg, piece: torch.Tensor, ins: Any) -> None:
        raise NotImplementedError

    # -- dispatch (a recomputed region's instructions are gathered, then run) -------------------
    def visit(self, ins: Any) -> Iterator[Wait] | None:
        if self._region is not None and ins.kind != "end_recompute":
            self._region[1].append(ins)
            return None
        handler = self._handler(ins)
        if not self._frozen:
            return handler(ins)
        # grad mode is per thread, and the in-process simulator runs every rank's walk in one
        # thread, switching at each wait: so it is set around each step, not for a whole unit
        with torch.no_grad():
            waits = handler(ins)
        return None if waits is None else _without_grad(waits)

    def prepare(self, program: Program) -> None:
        """What walking ``program`` looks up per instruction, worked out once per program: the
        weight halves' closed-form rules (``ssdsl.runtime.wgrad``). Every backend calls it
        before it walks (``run``, the simulator, the preflight, a generated module's step); a
        walk without it takes autograd for every weight half, which computes the same."""
        self._wrules = _once(self._wrules_of, program,
                             lambda: wgrad.rules_of(program) if wgrad.ENABLED else {})
        self._watched = _once(self._watched_of, program, lambda: written_places(program))

    def run(self, program: Program) -> None:
        """Walk all of ``program`` on a runner that never waits (the distributed one): what
        ``walk(program, self)`` does, with each instruction's handler looked up once per
        program instead of once per instruction and step."""
        self._dead = _once(self._dead_of, program,
                           lambda: dead_before_backwards(program) if liveness.ENABLED else {})
        self._edged = _once(self._edged_of, program,
                            lambda: held_as_edges(program) if liveness.ENABLED else {})
        self.prepare(program)
        if type(self).visit is not Runner.visit or not RUN_LOOP:  # a subclass dispatches its way
            for _ in walk(program, self):
                raise RuntimeError("a distributed runner never waits")
            return
        if straight_code.ENABLED:
            self._straight(program)()
            return
        steps = self._sequence(program)
        for ins, handler in steps:
            if self._region is None and not self._frozen:
                waits = handler(ins)
            else:
                waits = self.visit(ins)
            if waits is not None:
                for _ in waits:
                    raise RuntimeError("a distributed runner never waits")

    def _straight(self, program: Program) -> Any:
        """``program`` as generated straight-line code (``ssdsl.runtime.straight``), built once
        per program."""
        return _once(self._generated, program, lambda: straight_code.straight(self, program))

    def _sequence(self, program: Program) -> list[tuple[Any, Any]]:
        """``program``'s instructions, each beside its handler (built once per program)."""
        return _once(self._sequences, program,
                     lambda: [(ins, self._handler(ins)) for ins in program.instructions])

    def _handler(self, ins: Any) -> Any:
        """``ins``'s handler, built once (``ssdsl.runtime.prebuilt``; a subclass that overrides
        a handler gets its own): the program's instructions live as long as it, so their ids
        stay theirs; the instruction is kept beside its handler to make sure."""
        got = self._prebuilt.get(id(ins))
        if got is not None and got[0] is ins:
            return got[1]
        name = "on_" + ins.kind
        if PREBUILD and getattr(type(self), name) is getattr(Runner, name, None):
            handler = prebuild(self, ins)
        else:
            handler = getattr(self, name)
        self._prebuilt[id(ins)] = (ins, handler)
        return handler

    # -- units and values -----------------------------------------------------------------------
    def on_begin(self, ins) -> None:
        self._frozen = not ins.grad  # a forward-only unit: no autograd graph, nothing kept

    def on_end(self, ins) -> None:
        self._frozen = False
        if "F" in ins.unit:
            self.peak_live = max(self.peak_live, len(self.env))

    def on_input(self, ins) -> None:
        x = self.batch[ins.index]
        got = self._takes.get(id(ins))
        if got is None or got[0] is not ins:
            got = self._takes[id(ins)] = (ins, *take_index(ins))
        if got[2] is not None and x.shape == got[1]:  # a view, as slice_of gives
            self.env[ins.out] = x[got[2]] if got[2] else x
            return
        if ins.box is not None:
            x = ins.box.slice_of(x)
        self.env[ins.out] = ins.region.slice_of(x)

    def on_param(self, ins) -> None:
        self.env[ins.out] = scale_grad(self.state.leaves[(ins.tensor, ins.region)], ins.scale)

    def on_buffer(self, ins) -> None:
        self.env[ins.out] = self.state.fixed[(ins.tensor, ins.region)]

    def on_call(self, ins) -> None:
        env = self.env
        if self._watched and ins.ins and ins.ins[0] in self._watched \
                and writes_in_place(ins.call.target):
            t = env.get(ins.ins[0])
            if t is not None and t.grad_fn is not None:
                self.inplaced[ins.ins[0]] = get_gradient_edge(t)
        local = [None if v is None else env[v] for v in ins.ins]
        args, kwargs = ins.call.bind(local)
        if self.retype is not None:
            args, kwargs = retyped(args, self.retype), {k: retyped(v, self.retype)
                                                        for k, v in kwargs.items()}
        try:
            out = _call(ins.call.target, args, kwargs)
        except RuntimeError as err:  # name the operator: torch's message does not
            raise RuntimeError(f"operator '{ins.op}' ({ins.call.target}, part {ins.part}) on "
                               f"rank {self.rank}: {err}") from err
        outs = tuple(out) if ins.listy else (out,)
        if ins.call.scale != 1.0:
            outs = tuple(o * ins.call.scale for o in outs)
        env.update(zip(ins.outs, outs, strict=True))
        if ins.loss:
            self.record_loss(outs[0], ins.count)

    def on_cut(self, ins) -> None:
        src = self.env[ins.src]
        self.env[ins.out] = src.detach().requires_grad_(src.requires_grad)

    def on_free(self, ins) -> None:
        for table in (self.env, self.grads, self.kept, self.edges, self.cut_grads):
            if table:
                pop = table.pop
                for v in ins.values:
                    pop(v, None)

    # -- local communication ----------------------------------------------------------------------
    def local_steps(self, steps, held: list[torch.Tensor], like: torch.Tensor
                    ) -> list[torch.Tensor]:
        """Steps that exchange nothing with other ranks (copies, chunks, groups of one)."""
        for step in steps:
            if isinstance(step, Coll):
                held = [local_coll(step, self.rank, held[0])] if held else held
            else:
                whole = _whole_copies(step)
                outs = [torch.zeros(r.local_shape, dtype=like.dtype, device=like.device)
                        if j not in whole else None for j, r in enumerate(step.targets)]
                for msg in step.msgs:
                    piece = step.sources[msg.src_slot].extract(held[msg.src_slot], msg.region)
                    if msg.dst_slot in whole:
                        outs[msg.dst_slot] = piece.view_as(piece)
                        continue
                    step.targets[msg.dst_slot].add_into(outs[msg.dst_slot], msg.region, piece)
                held = outs
        return held

    def on_local(self, ins) -> None:
        inputs = [self.env[v] for v in ins.ins]
        like = inputs[0] if inputs else torch.empty(0, dtype=self.dtype, device=self.device)
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            outs = _LocalSteps.apply(self, ins, like.detach(), *inputs)
        else:
            outs = self.local_steps(ins.steps, inputs, like)
        self.env.update(zip(ins.outs, outs, strict=True))

    # -- communication --------------------------------------------------------------------------
    def on_comm(self, ins) -> Iterator[Wait]:
        dtype = _dtype(ins.dtype, self.dtype)
        if ins.backward:
            held = [self.grads.pop(v, None) for v in ins.ins]
            held = [g if g is not None else torch.zeros(s, dtype=dtype, device=self.device)
                    for g, s in zip(held, ins.shapes)]
        else:
            held = [self.env[v].detach() for v in ins.ins]
        # what travels has the instruction's dtype, which the receiving ranks allocate
        held = [h if h.dtype == dtype else h.to(dtype) for h in held]
        ident = ("comm", ins.edge, ins.mb, ins.backward)
        for step in ins.steps:
            if isinstance(step, Coll):
                if not held:
                    continue
                if step.meets:
                    w = Wait(self.rank, step, ins, ident, payload=held[0].contiguous())
                    yield from self.meet(w)
                    held = [w.result]
                else:
                    held = [local_coll(step, self.rank, held[0])]
            else:
                held = yield from self._p2p(step, held, dtype, ins)
        if ins.backward:
            for v, g in zip(ins.outs, held):
                have = self.grads.get(v)
                self.grads[v] = g if have is None else have + g
        else:
            for v, y in zip(ins.outs, held):
                if ins.grad and y.is_floating_point():
                    y = y.detach().requires_grad_(True)
                self.env[v] = y

    def _p2p(self, step: P2P, held: list[torch.Tensor], dtype: torch.dtype, ins
             ) -> Iterator[Wait]:
        whole = _whole_copies(step)
        outs = [torch.zeros(r.local_shape, dtype=dtype, device=self.device)
                if j not in whole else None for j, r in enumerate(step.targets)]
        recvs: list[tuple[Any, Wait]] = []
        for msg in step.msgs:
            if msg.kind == "copy":
                piece = step.sources[msg.src_slot].extract(held[msg.src_slot], msg.region)
                if msg.dst_slot in whole:
                    outs[msg.dst_slot] = piece.view_as(piece)
                    continue
                step.targets[msg.dst_slot].add_into(outs[msg.dst_slot], msg.region, piece)
            elif msg.kind == "send":
                piece = step.sources[msg.src_slot].extract(held[msg.src_slot], msg.region)
                self.post(msg, piece.contiguous(), ins)
            else:
                buf = torch.empty(msg.region.local_shape, dtype=dtype, device=self.device)
                recvs.append((msg, Wait(self.rank, msg, ins, payload=buf,
                                        shape=msg.region.local_shape)))
        yield from self.meet_all([w for _, w in recvs])
        for msg, w in recvs:
            if msg.dst_slot in whole:
                got = w.result
                outs[msg.dst_slot] = got if got.dtype == dtype else got.to(dtype)
                continue
            step.targets[msg.dst_slot].add_into(outs[msg.dst_slot], msg.region, w.result)
        return outs

    # -- backward -------------------------------------------------------------------------------
    def _starts(self, seeds, roots, take: bool = True
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Where a backward starts: loss parts (gradient one) and values whose gradient the
        table holds (taken out of it; with ``take=False`` left there for a second walk)."""
        env = self.env
        tensors, grads = [], []
        for v in seeds:
            t = env.get(v)
            if t is not None and t.requires_grad:
                tensors.append(t)
                grads.append(torch.ones_like(t))
        table = self.grads
        for v in roots:
            t, g = env.get(v), table.pop(v, None) if take else table.get(v)
            if t is not None and g is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g)
        return tensors, grads

    def _drop_dead(self, ins) -> None:
        """What no later instruction reads leaves ``env`` (``runtime.liveness``)."""
        got = self._dead.get(id(ins))
        if got is not None and got[0] is ins:
            pop = self.env.pop
            for v in got[1]:
                pop(v, None)

    def on_backward(self, ins) -> None:
        if self._dead:
            self._drop_dead(ins)
        part = ins.part
        if part == "sent":
            return self._backward_sent(ins)
        tensors, grads = self._starts(ins.seeds, ins.roots)
        if tensors:
            torch.autograd.backward(tensors, grads)
        if part == "rest":  # the collected leaves' gradients left with the first walk
            env = self.env
            for leaf, _ in ins.collect:
                t = env.get(leaf)
                if t is not None:
                    t.grad = None
            return None
        self._collect(ins.collect)

    def _backward_sent(self, ins) -> None:
        """The first walk of a two-walk backward: the collected leaves' gradients alone (autograd
        computes only what lies on their way), the graph and the roots' gradients kept."""
        tensors, grads = self._starts(ins.seeds, ins.roots, take=False)
        env = self.env
        pairs = [(leaf, into) for leaf, into in ins.collect
                 if leaf in env and env[leaf].requires_grad]
        if not tensors or not pairs:
            return
        got = torch.autograd.grad(tensors, [env[leaf] for leaf, _ in pairs], grads,
                                  retain_graph=True, allow_unused=True)
        table = self.grads
        for (_, into), g in zip(pairs, got):
            if g is not None:
                have = table.get(into)
                table[into] = g if have is None else have + g

    def _collect(self, collect) -> None:
        env = self.env
        for leaf, into in collect:
            t = env.get(leaf)
            if t is not None and t.grad is not None:
                have = self.grads.get(into)
                self.grads[into] = t.grad if have is None else have + t.grad
                t.grad = None

    def on_backward_input(self, ins) -> None:
        """Gradients of the received leaves only; the kept outputs' gradients come along (they
        lie on the way), the weight cuts' do not (nobody asks for them) but those of the calls
        whose weight gradient the input half's own kernels give (``wgrad.EARLY``: layer norms),
        and the graph stays for the weight half."""
        if self._dead:
            self._drop_dead(ins)
        env = self.env
        early = self._wrules.get(id(ins))
        early = early[1] if early is not None and early[0] is ins else ()
        names = [v for v in (*ins.inputs, *ins.keep, *early) if v in env and env[v].requires_grad]
        inplaced = self.inplaced
        places = [inplaced.get(v) or env[v] for v in names] if inplaced else \
            [env[v] for v in names]
        if self._edged:  # kept outputs nothing reads again but as graph places (liveness)
            held = self._edged.get(id(ins))
            if held is not None and held[0] is ins:
                edges, at = self.edges, {v: k for k, v in enumerate(names)}
                for v in held[1]:
                    k = at.get(v)
                    if k is not None and v in inplaced:
                        edges[v] = places[k]
                        del env[v]
                    elif k is not None and places[k].grad_fn is not None:
                        places[k] = edges[v] = get_gradient_edge(places[k])
                        del env[v]
        tensors, grads = self._starts(ins.seeds, ins.roots)
        if tensors and names:
            # autograd.grad hands the gradients over as they are; backward(inputs=...) would
            # accumulate each into a .grad, copying every one that autograd still holds
            got = torch.autograd.grad(tensors, places, grads, retain_graph=True,
                                      allow_unused=True)
            keep = set(ins.keep)
            cut_grads = self.cut_grads
            for v, g in zip(names, got):
                if g is None:
                    continue
                if early and v in early:
                    cut_grads[v] = g
                elif v in keep:
                    have = self.kept.get(v)
                    self.kept[v] = g if have is None else have + g
                else:
                    t = env[v]
                    t.grad = g if t.grad is None else t.grad + g
        self._collect(ins.collect)

    def on_backward_weight(self, ins) -> None:
        """Each mixing call's weight cuts from its outputs' kept gradients (in closed form where
        ``runtime.wgrad`` has a rule for the call, else autograd through that call alone: the
        cuts are read by it only), then the weight side into the parameters."""
        tensors, grads = self._starts(ins.seeds, ins.roots)
        env, kept = self.env, self.kept
        ruled = self._wrules.get(id(ins))
        rules = ruled[1] if ruled is not None and ruled[0] is ins else ()
        cut_grads = self.cut_grads
        for k, (outs, cuts) in enumerate(ins.mixes):
            rule = rules[k] if rules else None
            if cut_grads and any(c in cut_grads for c, _ in cuts):  # from the input half
                # (``wgrad.EARLY``): a cut without one there needs no gradient
                for o in outs:
                    kept.pop(o, None)
                for cut, src in cuts:
                    g = cut_grads.pop(cut, None)
                    if g is not None:
                        tensors.append(env[src])
                        grads.append(g)
                self.closed_form += 1
                self.from_input_half += 1
                continue
            if rule is not None:
                made = rule(env, kept)
                if made is not None:  # the cuts' gradients in closed form (``runtime.wgrad``)
                    for o in outs:
                        kept.pop(o, None)
                    src = dict(cuts)
                    for cut, g in made:
                        tensors.append(env[src[cut]])
                        grads.append(g)
                    self.closed_form += 1
                    continue
            ys = [(self.inplaced.get(o) or (env[o] if o in env else self.edges[o]),
                   self.kept.pop(o)) for o in outs if o in self.kept]
            cs = [(env[c], src) for c, src in cuts if env[c].requires_grad]
            if not ys or not cs:
                continue
            got = torch.autograd.grad([y for y, _ in ys], [c for c, _ in cs],
                                      [g for _, g in ys], allow_unused=True)
            for (_, src), g in zip(cs, got):
                if g is not None:
                    tensors.append(env[src])
                    grads.append(g)
        if tensors:
            # each gradient has its tensor's shape and dtype (a cut is its source detached):
            # the engine without ``autograd.backward``'s per-tensor checks
            _run_backward(tensors, grads)

    # -- recompute ------------------------------------------------------------------------------
    def on_recompute(self, ins) -> None:
        self._region = (ins, [])

    def on_end_recompute(self, ins) -> None:
        begin, body = self._region
        self._region = None

        def run_body(_env: dict) -> None:
            for x in body:
                if Handler.visit(self, x) is not None:
                    raise RuntimeError("a recomputed region communicates")
        self.recomputed(begin, run_body)

    def recomputed(self, begin, body) -> None:
        """Run ``body(env)`` (which reads ``begin.ins`` from ``env`` and writes ``begin.outs``)
        keeping none of its activations: backward runs it again."""
        calls = [0]

        def segment(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            saved, replay = self.env, self._replay
            self.env = dict(zip(begin.ins, values))
            self._replay = calls[0] > 0
            calls[0] += 1
            try:
                body(self.env)
                return tuple(self.env[v] for v in begin.outs)
            finally:
                self.env, self._replay = saved, replay

        values = [self.env[v] for v in begin.ins]
        results = checkpoint(segment, *values, use_reentrant=False)
        self.env.update(zip(begin.outs, results, strict=True))

    def record_loss(self, value: torch.Tensor, count: bool) -> None:
        """Keep a loss part for the step's loss (not again when a region is recomputed)."""
        if not self._replay:
            self.losses.append((value, count))

    # -- the step's tail ------------------------------------------------------------------------
    def on_wait_sends(self, ins) -> None:
        return None

    def _grad_of(self, key: tuple[str, Region]) -> torch.Tensor:
        leaf = self.state.leaves[key]
        if leaf.grad is None:
            leaf.grad = torch.zeros_like(leaf)
        return leaf.grad

    def _bucket_leaves(self, ins) -> list[torch.Tensor]:
        """The weight leaves of bucket instruction ``ins`` (looked up once per state)."""
        got = self._leaves_of.get(id(ins))
        if got is None or got[0] is not ins or got[1] is not self.state:
            got = self._leaves_of[id(ins)] = (ins, self.state,
                                              [self.state.leaves[e] for e in ins.entries])
        return got[2]

    def _bucket_slots(self, ins) -> list[Slot] | None:
        """The slots of bucket instruction ``ins``'s entries where one of them is a slice of a
        leaf (a weight summed piece by piece, ``ssdsl.runtime.slots``), else None."""
        got = self._slots_of.get(id(ins))
        if got is None or got[0] is not ins or got[1] is not self.state:
            got = self._slots_of[id(ins)] = (ins, self.state,
                                             slots_of(self.state.leaves, ins.entries))
        return got[2]

    def on_reduce(self, ins) -> Iterator[Wait]:
        slots = self._bucket_slots(ins)
        if slots is not None:
            return (yield from self._reduce_slots(ins, slots))
        leaves = self._bucket_leaves(ins)
        grads = [leaf.grad if leaf.grad is not None else self._grad_of(e)
                 for leaf, e in zip(leaves, ins.entries)]
        if ins.zero >= 2:
            yield from self._reduce_scatter(ins, _flatten(grads))
            return
        w = yield from self._meet_bucket(ins, grads)
        if grads and ins.zero:
            torch._foreach_copy_(grads, _unflatten(w.result, grads))
        elif grads:
            # the reduced gradients are views of the reduced buffer, which this rank alone
            # holds until the next step's ``zero_grad`` drops them: no copy back
            for leaf, grad in zip(leaves, _unflatten(w.result, grads)):
                leaf.grad = grad
        offset = sum(g.numel() for g in grads)
        if ins.loss:
            self.loss_total = float(w.result[offset].item())
        if ins.zero:  # stage 1: every member keeps the whole gradient, steps only its chunk
            shard = self.zero[ins.bucket]
            shard.set_grad(w.result[shard.lo:offset])

    def _meet_bucket(self, ins, grads: list[torch.Tensor]) -> Iterator[Wait]:
        """The all-reduce of bucket ``ins``: ``grads`` flat, with this rank's share of the loss
        at the end where the bucket carries it; the met ``Wait`` (its ``result``)."""
        flat = list(grads)
        if ins.loss:
            flat.append(self._my_loss_tensor(flat[0].dtype if flat else torch.float64))
        w = Wait(self.rank, Coll("all_reduce", ins.group), ins, ("reduce", ins.bucket),
                 payload=_flatten(flat))
        yield from self.meet(w)
        return w

    def _reduce_slots(self, ins, slots: list[Slot]) -> Iterator[Wait]:
        """A bucket some of whose entries are slices of this rank's leaves: the slices are
        taken out, all-reduced with the rest (the same flat layout as every member's), and
        written back (the reducer never shards such a bucket)."""
        if ins.zero:
            raise AssertionError("a ZeRO bucket with sliced entries (the reducer refuses it)")
        grads = [s.grad() for s in slots]
        w = yield from self._meet_bucket(ins, grads)
        for slot, grad in zip(slots, pieces(w.result, [s.shape for s in slots])):
            slot.put(grad)
        if ins.loss:
            self.loss_total = float(w.result[sum(g.numel() for g in grads)].item())

    def _reduce_scatter(self, ins, flat: torch.Tensor) -> Iterator[Wait]:
        """ZeRO stage 2: this rank keeps the reduced gradient of its chunk only."""
        shard = self.zero[ins.bucket]
        w = Wait(self.rank, Coll("reduce_scatter", ins.group), ins, ("reduce", ins.bucket),
                 payload=shard.pad(flat))
        yield from self.meet(w)
        shard.set_grad(w.result)
        for e in ins.entries:
            self.state.leaves[e].grad = None

    def on_gather(self, ins) -> Iterator[Wait]:
        shard = self.zero[ins.bucket]
        w = Wait(self.rank, Coll("all_gather", ins.group), ins, ("gather", ins.bucket),
                 payload=shard.padded_chunk.detach().clone())
        yield from self.meet(w)
        shard.gathered(w.result)

    # -- ZeRO stage 3: weights gathered around their uses ---------------------------------------
    def on_gather_params(self, ins) -> Iterator[Wait]:
        shard = self.zero[ins.bucket]
        shard.allocate()
        w = Wait(self.rank, Coll("all_gather", ins.group), ins, ("gather_params", ins.bucket),
                 payload=shard.store.detach().clone())
        yield from self.meet(w)
        shard.gathered(w.result)

    def on_wait_params(self, ins) -> None:
        return None

    def on_free_params(self, ins) -> None:
        self.zero[ins.bucket].release()

    def _my_loss(self) -> float:
        """The sum of the loss parts this rank counts."""
        return float(sum(float(x.detach()) for x, counted in self.losses if counted))

    def _my_loss_piece(self) -> torch.Tensor | None:
        """What ``_my_loss_tensor`` holds, to be copied from: the counted loss part itself
        where there is one (never written into), their float64 sum where there are several,
        None where this rank counts none."""
        parts = [x for x, counted in self.losses if counted]
        if len(parts) < 2:
            return parts[0] if parts else None
        return torch.stack([x.detach() for x in parts]).to(torch.float64).sum()

    def _my_loss_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """``_my_loss()`` as a one-element tensor of ``dtype``, made without reading the value
        out (no ``item``, no tensor made from a Python number): the parts are added in float64,
        as ``_my_loss`` adds them. A new tensor, never a view of a loss part: collectives write
        into it."""
        piece = self._my_loss_piece()
        if piece is None:
            return torch.zeros(1, dtype=dtype)
        return piece.detach().reshape(1).to(dtype, copy=True)

    def on_loss_sum(self, ins) -> Iterator[Wait] | None:
        if len(ins.group) == 1:  # nothing to add: this rank's share is the loss
            self.loss_total = self._my_loss()
            return None
        return self._loss_sum(ins)

    def _loss_sum(self, ins) -> Iterator[Wait]:
        w = Wait(self.rank, Coll("all_reduce", ins.group), ins, ("loss",),
                 payload=self._my_loss_tensor(torch.float64))
        yield from self.meet(w)
        self.loss_total = float(w.result.item())

    def on_step(self, ins) -> None:
        if self._stepped is None or self._stepped[0] is not self.state:
            # the leaves the optimizer steps whole, found once per state
            sharded = {e for shard in self.zero.values() for e in shard.ins.entries}
            self._stepped = (self.state, [leaf for key, leaf in self.state.leaves.items()
                                          if key not in sharded])
        for leaf in self._stepped[1]:
            if leaf.grad is None:
                leaf.grad = torch.zeros_like(leaf)
        for shard in self.zero.values():
            if shard.param.grad is None:
                shard.link_grads()
        if self.opt is not None:
            self.opt.step()


class DistRunner(Runner):
    """Communication on torch.distributed: collectives and receives happen where they stand."""

    def __init__(self, *args: Any, groups: ProcessGroups | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups = groups
        # reduce-scatters in flight: work, shard, result, input (kept alive until done)
        self.pending: list[tuple[Any, ZeroShard, torch.Tensor, torch.Tensor]] = []
        # receives posted before the instruction that waits for them (``ssdsl.runtime.early``):
        # what to post at the start of each unit of a whole step, and what is posted
        self.early: tuple[tuple[EarlyRecv, ...], ...] = ()
        self.posted: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._units = 0
        # buckets reduced during the last backward (``ssdsl.runtime.overlap``): the plan of a
        # whole step, the parts started, the backwards seen
        self.overlap: OverlapPlan | None = None
        # (bucket -> [(part, work, its FlatGrads or None, the tensor reduced)]); ``parts``: the
        # program's parts on this rank's leaves
        self.started: dict[int, list[tuple[int, Any, FlatGrads | None, torch.Tensor]]] = {}
        self.parts: Parts | None = None
        self._backwards = 0
        self.counts = {"posted_early": 0, "parts_overlapped": 0, "loss_early": 0,
                       "sends_threaded": 0, "flat_reduced": 0,
                       "sends_shm": 0}  # over the run, for tests
        self._bucket_groups: dict[int, tuple[int, ...]] = {}
        # (kind, bucket or part) -> (its leaves, their flat buffer or None): ``_flat_of``
        self._flats: dict[tuple, tuple[list, FlatGrads | None]] = {}
        # the loss's all-reduce started while the step runs (``ssdsl.runtime.early_loss``): where
        # in a whole step, the units ended so far, the all-reduce in flight and its buffer
        self.loss_plan: LossPlan | None = None
        self._ends = 0
        self._loss_work: tuple[Any, torch.Tensor] | None = None
        self._threaded = False
        self._sender: sending.Sender | None = None

    def start(self, batch: tuple[torch.Tensor, ...]) -> None:
        super().start(batch)
        self._units = 0
        self._backwards = 0
        self._ends = 0
        self._loss_work = None
        self.started = {}
        # whether this step's sends go through the process's sender thread
        # (``ssdsl.runtime.sender``, started by the first send) is settled at the step's first
        # send: a step that sends nothing (data parallelism) asks nothing
        self._threaded: bool | None = None
        self._sender = None

    # -- buckets reduced during the last backward --------------------------------------------------
    def on_backward(self, ins) -> None:
        with self._overlapping():
            super().on_backward(ins)

    def on_backward_weight(self, ins) -> None:
        with self._overlapping():
            super().on_backward_weight(ins)

    @contextmanager
    def _overlapping(self) -> Iterator[None]:
        """Around a backward: in the program's last one, each overlapped bucket part starts
        (in order) once autograd has accumulated all its gradients; the rest right after."""
        plan, i = self.overlap, self._backwards
        self._backwards += 1
        if plan is None or i != plan.last or self.parts is None:
            yield
            return
        self.parts.begin()
        try:
            yield
        finally:
            self.parts.finish()

    def _start_part(self, k: int) -> None:
        bucket, _ = self.parts.order[k]
        leaves = self.parts.leaves[k]
        carrier = k == self.parts.carrier
        sliced = self.parts.slots[k] is not None
        flat = None if sliced else self._flat_of(("part", k), leaves, carrier)
        if flat is not None:
            buf = flat.fill(leaves, self._my_loss_piece() if carrier else None)
            self.counts["flat_reduced"] += 1
        else:
            grads = ([s.grad() for s in self.parts.slots[k]] if sliced else
                     [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                      for leaf in leaves])
            if carrier:
                grads.append(self._my_loss_tensor(grads[0].dtype))
            buf = _flatten(grads)
        group = self._bucket_groups[bucket]
        work = exchange.all_reduce(buf, group=self.groups.get(group) if self.groups else None,
                                   async_op=True)
        self.started.setdefault(bucket, []).append((k, work, flat, buf))
        self.counts["parts_overlapped"] += 1

    def _flat_of(self, key: tuple, leaves: list[torch.Tensor], loss: bool) -> FlatGrads | None:
        """The flat buffer of a bucket or overlapped part (``ssdsl.runtime.flat``), made once
        for its list of leaves (which lives as long as the rank's state)."""
        got = self._flats.get(key)
        if got is None or got[0] is not leaves:
            got = self._flats[key] = (leaves, flat_grads(leaves, loss))
        return got[1]

    def on_reduce(self, ins) -> Iterator[Wait]:
        parts = self.started.pop(ins.bucket, None)
        if parts is None:
            if ins.zero or len(ins.group) < 2 or self._bucket_slots(ins) is not None:
                return (yield from super().on_reduce(ins))
            leaves = self._bucket_leaves(ins)
            flat = self._flat_of(("bucket", ins.bucket), leaves, ins.loss)
            if flat is None:
                return (yield from super().on_reduce(ins))
            # the same all-reduce as ``Runner.on_reduce``'s, written into the buffer whose
            # views become the gradients
            buf = flat.fill(leaves, self._my_loss_piece() if ins.loss else None)
            exchange.all_reduce(buf, group=self.groups.get(ins.group) if self.groups else None)
            flat.hand_out(leaves)
            if ins.loss:
                self.loss_total = flat.loss()
            self.counts["flat_reduced"] += 1
            return
        for k, work, flat, buf in parts:
            work.wait()
            leaves = self.parts.leaves[k]
            slots = self.parts.slots[k]
            if flat is not None:
                flat.hand_out(leaves)
            elif slots is not None:  # slices of leaves: written back into them
                for slot, grad in zip(slots, pieces(buf, [s.shape for s in slots])):
                    slot.put(grad)
            else:
                # the reduced gradients are views of the part's buffer, which this rank alone
                # holds until the next step's ``zero_grad`` drops them: no copy back
                for leaf, grad in zip(leaves, _unflatten(buf, leaves)):
                    leaf.grad = grad
            if k == self.parts.carrier:  # the loss rode at the end of this part
                self.loss_total = float(buf[-1].item())

    # -- the loss summed while the step runs ---------------------------------------------------------
    def _start_loss(self) -> None:
        buf = self._my_loss_tensor(torch.float64)
        group = self.loss_plan.group
        work = exchange.all_reduce(buf, group=self.groups.get(group) if self.groups else None,
                                   async_op=True)
        self._loss_work = (work, buf)
        self.counts["loss_early"] += 1

    def on_end(self, ins) -> None:
        super().on_end(ins)
        self._ends += 1
        if self.loss_plan is not None and self._ends - 1 == self.loss_plan.after:
            self._start_loss()

    def on_loss_sum(self, ins) -> Iterator[Wait] | None:
        if self._loss_work is None and self.loss_plan is not None:
            # a rank that runs no unit (a device the plan leaves empty) never reaches the
            # ``on_begin`` that starts a share known from the start: it starts it here, so that
            # every member of the loss's group issues the same all-reduce (the early one; the
            # one ``LossSum`` issues in place may run another algorithm, ``exchange.all_reduce``
            # with and without ``async_op`` over a group that is not a power of two)
            self._start_loss()
        if self._loss_work is None:
            return super().on_loss_sum(ins)
        work, buf = self._loss_work
        self._loss_work = None
        work.wait()
        self.loss_total = float(buf.item())
        return None

    def on_begin(self, ins) -> None:
        super().on_begin(ins)
        if self._units == 0 and self.loss_plan is not None and self.loss_plan.after == -1:
            self._start_loss()  # this rank counts no loss part: its share is known now
        i, self._units = self._units, self._units + 1
        for r in self.early[i] if i < len(self.early) else ():
            buf = torch.empty(r.shape, dtype=_dtype(r.dtype, self.dtype), device=self.device)
            self.posted[(r.peer, r.tag)] = (self._irecv(buf, r.peer, r.tag), buf)
            self.counts["posted_early"] += 1

    def _irecv(self, buf: torch.Tensor, peer: int, tag: int) -> Any:
        """A receive to wait for later: through shared memory from a rank of this host
        (``ssdsl.runtime.shm``), else the backend's ``irecv``."""
        shm = self.groups.same_host if self.groups is not None else None
        if shm is not None and shm.handles(peer, buf):
            return shm.irecv(buf, peer, tag)
        return dist.irecv(buf, peer, tag=tag)

    def _posted(self, w: Wait) -> torch.Tensor | None:
        """The buffer of ``w``'s receive if it was posted early, after waiting for it."""
        got = self.posted.pop((w.what.peer, w.what.tag), None)
        if got is None:
            return None
        got[0].wait()
        return got[1]

    def meet(self, w: Wait) -> Iterator[Wait]:
        if isinstance(w.what, Coll):
            w.result = coll_on_rank(w.what, self.rank, w.payload, self.groups)
        else:
            w.result = self._posted(w)
            if w.result is None:
                self._irecv(w.payload, w.what.peer, w.what.tag).wait()
                w.result = w.payload
        return iter(())

    def meet_all(self, ws: list[Wait]) -> Iterator[Wait]:
        reqs = [None if (w.what.peer, w.what.tag) in self.posted
                else self._irecv(w.payload, w.what.peer, w.what.tag) for w in ws]
        for w, req in zip(ws, reqs):
            if req is None:
                w.result = self._posted(w)
            else:
                req.wait()
                w.result = w.payload
        return iter(())

    def post(self, msg, piece: torch.Tensor, ins: Any) -> None:
        shm = self.groups.same_host if self.groups is not None else None
        if shm is not None and shm.handles(msg.peer, piece):
            shm.send(piece, msg.peer, msg.tag)  # complete on return: the bytes are copied
            self.counts["sends_shm"] += 1
            return
        if self._threaded is None:
            self._threaded = sending.wanted()
        if self._threaded:
            if self._sender is None:
                self._sender = sending.sender()
            self._sender.post(piece, msg.peer, msg.tag)
            self.counts["sends_threaded"] += 1
        else:
            isend(piece, msg.peer, msg.tag)

    def on_wait_sends(self, ins) -> None:
        if self._sender is not None:
            self._sender.wait()
        wait_sends()

    # ZeRO stage 3 on torch.distributed: the all-gather runs in flight from ``GatherParams`` to
    # ``WaitParams`` (a prefetch overlaps the layer before), straight into the flat buffer whose
    # views the weights are; a stage-3 reduce-scatter runs in flight until the optimizer step
    def on_gather_params(self, ins) -> None:
        shard = self.zero[ins.bucket]
        shard.allocate()
        shard.work = start_all_gather_into(shard.buffer, shard.store, ins.group, self.groups)

    def on_wait_params(self, ins) -> None:
        shard = self.zero[ins.bucket]
        if shard.work is not None:
            shard.work.wait()
            shard.work = None

    def on_free_params(self, ins) -> None:
        self.on_wait_params(ins)
        self.zero[ins.bucket].release()

    def _reduce_scatter(self, ins, flat: torch.Tensor) -> Iterator[Wait]:
        if ins.zero != 3:
            return (yield from super()._reduce_scatter(ins, flat))
        shard = self.zero[ins.bucket]
        out = torch.empty(shard.chunk, dtype=flat.dtype, device=flat.device)
        padded = shard.pad(flat)
        work = start_reduce_scatter(out, padded, ins.group, self.groups)
        self.pending.append((work, shard, out, padded))
        for e in ins.entries:
            self.state.leaves[e].grad = None

    def on_step(self, ins) -> None:
        for work, shard, out, _ in self.pending:
            work.wait()
            shard.set_grad(out)
        self.pending = []
        super().on_step(ins)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements one after the other in a new 1-d tensor (one C++ call)."""
    return torch._C._nn.flatten_dense_tensors(tensors) if tensors else torch.empty(0)


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``, one per tensor of ``like`` and shaped like it, one after the other
    (what follows them in ``flat`` is left out)."""
    return list(torch._C._nn.unflatten_dense_tensors(flat, like)) if like else []


def input_rows(program: Program) -> tuple[int, int] | None:
    """The rows (dim 0, ``start, stop``) of the global batch that ``program`` takes, None when
    it takes none: the span of every ``TakeInput``'s rows (micro-batch box, then region)."""
    rows: set[int] = set()
    for ins in program.instructions:
        if ins.kind != "input":
            continue
        region = ins.region
        if ins.box is None:
            global_rows = [i for a, b in region.intervals[0] for i in range(a, b)]
        else:
            box_rows = [i for a, b in ins.box.intervals[0] for i in range(a, b)]
            global_rows = [box_rows[j] for a, b in region.intervals[0] for j in range(a, b)]
        rows.update(global_rows)
    return (min(rows), max(rows) + 1) if rows else None


class RankProgram:
    """One rank's trainer: its lowered program, shards, optimizer and training step.

    ``program`` defaults to ``lower_rank(m, rank)``; pass one to run a program read back from
    its text (``ssdsl.lower.parse_program``) or otherwise prepared.
    """

    def __init__(self, m: Materialized, rank: int, model_file: ModelFile, model: torch.nn.Module,
                 *, dtype: torch.dtype, optimizer: OptimizerSpec, groups: ProcessGroups | None,
                 program: Program | None = None):
        self.m, self.rank, self.mf, self.dtype = m, rank, model_file, dtype
        hostmem.keep()  # this process trains: a step reuses the host memory the last one freed
        self.graph = m.transformed.graph
        self.groups = groups
        self.state = self._init_state(model)
        self.program = program if program is not None else lower_rank(m, rank)
        # the optimizer steps only this rank's chunk of a ZeRO-sharded bucket
        self.zero = zero_shards(self.program, self.state.leaves)
        self.opt = build_optimizer(optimizer, model_file,
                                   *optimizer_params(self.state.leaves, self.zero))
        self.runner = DistRunner(rank, self.state, dtype=dtype, opt=self.opt, groups=groups,
                                 zero=self.zero)
        self._early: tuple | None = None  # early_receives(program), on the first whole step
        self._loss_plan: LossPlan | None = None
        self._overlap: OverlapPlan | None = None
        self._step_values: tuple | None = None  # (graph, its step_values_code), on first use

    def _overlap_plan(self) -> OverlapPlan | None:
        """The buckets this rank reduces during its last backward (``ssdsl.runtime.overlap``),
        with what the runner needs of them."""
        reduces = {ins.bucket: ins for ins in self.program.instructions if ins.kind == "reduce"}
        # by the entry's region: the same on every member (a slice of a leaf counts its own)
        nbytes = {e: e[1].numel() * slot_of(self.state.leaves, e).leaf.element_size()
                  for ins in reduces.values() for e in ins.entries}
        plan = overlap_plan(self.program, nbytes)
        runner = self.runner
        runner._bucket_groups = {b: ins.group for b, ins in reduces.items()}
        if plan is not None:
            runner.parts = Parts(plan, {b: ins.entries for b, ins in reduces.items()},
                                 self.state.leaves, runner._start_part,
                                 carrier=next((b for b, ins in reduces.items() if ins.loss),
                                              None))
        return plan

    def _init_state(self, model: torch.nn.Module) -> RankState:
        """This rank's shards (swap this to initialise them otherwise)."""
        return init_state(self.m, self.rank, model)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now (after a
        step: the gradients it stepped on)."""
        return model_state_bytes(self.state.leaves, self.zero, self.opt)

    @property
    def peak_live(self) -> int:
        """The most values (activations, shards taken, cuts) alive at once after a forward unit."""
        return self.runner.peak_live

    @property
    def recompute(self) -> frozenset[str]:
        """The operators whose calls this rank recomputes."""
        out, inside = set(), False
        for ins in self.program.instructions:
            inside = (inside or ins.kind == "recompute") and ins.kind != "end_recompute"
            if inside and ins.kind == "call":
                out.add(ins.op)
        return frozenset(out)

    # -- partial walks (tests look inside a step) ------------------------------------------------
    def begin(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Start a step on the whole batch (every micro-batch's slice is taken from it), with
        the step values the graph's prologue computes from it (a loss's count of labelled
        tokens, ``ssdsl.transform.normalize``)."""
        values = getattr(self, "_step_values", None)
        if values is None or values[0] is not self.graph:
            values = self._step_values = (self.graph, step_values_code(self.graph))
        self.runner.start(values[1](to_dtype(tuple(batch), self.dtype)))
        self.runner.prepare(self.program)

    def run_unit(self, unit: str) -> None:
        """Run the instructions of one unit (``'0F1'``) of this rank's program."""
        inside = False
        for ins in self.program.instructions:
            if ins.kind == "begin" and ins.unit == unit:
                inside = True
            if inside:
                for _ in self.runner.visit(ins) or ():
                    raise RuntimeError("a distributed runner never waits")
            if ins.kind == "end" and ins.unit == unit:
                return

    def forward_unit(self, stage: int, k: int) -> None:
        self.run_unit(f"{stage}F{k}")

    # -- one step ---------------------------------------------------------------------------------
    def step(self, step: int, batch_size: int | None) -> float:
        """One training step on the model file's batch ``step``; the loss of the whole batch.

        With ``get_batch_shard`` in the model file this rank loads only the rows its program
        takes (``input_rows``); the rest of the batch stays zeros it never reads. A graph with
        step values (a loss's count over the whole batch) needs the whole batch on every rank."""
        if self.mf.get_batch_shard_fn is not None and not self.graph.prologue:
            return self.train_batch(self._rows_of_batch(step, batch_size))
        inputs, target = self.mf.get_batch(step, batch_size)
        return self.train_batch((*inputs, target))

    def _rows_of_batch(self, step: int, batch_size: int | None) -> tuple[torch.Tensor, ...]:
        """The global batch with only this rank's rows loaded (zeros elsewhere)."""
        g = self.graph
        shapes = [tuple(g.tensors[n].shape) for n in g.batch_inputs]
        rows = input_rows(self.program)
        if rows is None:  # this rank takes no input (a middle pipeline stage)
            return tuple(torch.zeros(sh, dtype=getattr(torch, g.tensors[n].dtype.split(".")[-1]))
                         for n, sh in zip(g.batch_inputs, shapes))
        inputs, target = self.mf.get_rows(step, batch_size, *rows)
        got = (*inputs, target)
        if len(got) != len(shapes) or any(tuple(t.shape[1:]) != sh[1:]
                                          for t, sh in zip(got, shapes)):
            raise ModelFileContract(
                f"get_batch_shard({step}, ..., {rows[0]}, {rows[1]}) returned shapes "
                f"{[tuple(t.shape) for t in got]}; get_batch's rows {rows[0]}:{rows[1]} have "
                f"{[(rows[1] - rows[0], *sh[1:]) for sh in shapes]}", file=self.mf.path)
        out = []
        for t, sh in zip(got, shapes):
            full = torch.zeros(sh, dtype=t.dtype)
            full[rows[0]:rows[1]] = t
            out.append(full)
        return tuple(out)

    def train_batch(self, batch: tuple[torch.Tensor, ...]) -> float:
        """The whole program on the global batch ``(*inputs, target)``, the same on every rank:
        forward, backward, gradient buckets, optimizer step; returns the batch's loss."""
        self.opt.zero_grad(set_to_none=True)
        self.begin(batch)
        with self.whole_step():
            self.runner.run(self.program)
        self.runner.env, self.runner.grads = {}, {}
        return self.runner.loss_total

    @contextmanager
    def whole_step(self) -> Iterator[None]:
        """Around a walk of the whole program: receives are posted a unit ahead
        (``ssdsl.runtime.early``), buckets reduced during the last backward
        (``ssdsl.runtime.overlap``) and the loss summed as soon as this rank's share is known
        (``ssdsl.runtime.early_loss``); a partial walk (``run_unit``) does none of them."""
        runner = self.runner
        if self._early is None:
            self._early = early_receives(self.program)
            self._overlap = self._overlap_plan()
            self._loss_plan = loss_plan(self.program)
        runner.early, runner.overlap = self._early, self._overlap
        runner.loss_plan = self._loss_plan
        try:
            yield
        finally:
            runner.early, runner.overlap, runner.loss_plan = (), None, None
        if runner.posted:  # every posted receive is waited for by its instruction
            raise RuntimeError(f"rank {self.rank}: receives posted early and never waited for: "
                               f"{sorted(runner.posted)}")

    # -- results ---------------------------------------------------------------------------------
    def _gather_weights(self) -> None:
        """Stage 3: every sharded bucket gathered once more, so that the weights can be read
        (collective: every rank calls ``shards`` at the end of a run)."""
        for bucket, shard in sorted(self.zero.items()):
            if shard.store is not None and not shard.allocated:
                shard.allocate()
                start_all_gather_into(shard.buffer, shard.store, shard.ins.group,
                                      self.groups).wait()

    def shards(self) -> list[tuple[str, Region, torch.Tensor]]:
        """This rank's parameter shards as (qualified name, region, values); a tied parameter
        under each of its names, as ``state_dict`` lists it."""
        self._gather_weights()
        return [(qual, region, t.detach().cpu().clone())
                for (name, region), t in self.state.leaves.items()
                for qual in (self.graph.params[name], *self.graph.aliases.get(
                    self.graph.params[name], ()))]


def _call(target: str, args: tuple, kwargs: dict) -> Any:
    """``call_target``, with a ``view`` that cannot alias its input done as a reshape.

    A graph traced on real tensors omits the ``contiguous()`` that was a no-op there (attention's
    output was already laid out for the view); a received activation can be laid out otherwise.
    """
    if args and writes_in_place(target) and isinstance(args[0], torch.Tensor) \
            and args[0].is_leaf and args[0].requires_grad:
        # a value this rank received or cut (a leaf of its autograd graph, which autograd does
        # not let an in-place op write): its copy is written; nothing on the rank aliases it
        args = (args[0].clone(), *args[1:])
    try:
        return call_target(target, args, kwargs)
    except RuntimeError:
        if target != "aten.view.default":
            raise
        return torch.ops.aten.reshape.default(*args, **kwargs)


def written_places(program: Program) -> frozenset[str]:
    """The places of ``program``'s split backwards (the outputs an input half keeps the
    gradient of, the outputs of a weight half's mixing calls) that an in-place call writes
    afterwards: ``Runner.on_call`` takes their gradient edge before it does."""
    places: set[str] = set()
    for ins in program.instructions:
        if isinstance(ins, BackwardInput):
            places.update(ins.keep)
        elif isinstance(ins, BackwardWeight):
            for outs, _ in ins.mixes:
                places.update(outs)
    if not places:
        return frozenset()
    return frozenset(ins.ins[0] for ins in program.instructions
                     if ins.kind == "call" and ins.ins and ins.ins[0] in places
                     and writes_in_place(ins.call.target))


def assemble(shards: list[tuple[str, Region, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's shards (a region held by several ranks is taken once);
    copies whose regions overlap unequally (a partition nested in one part) hold the same values
    where they overlap: each is written over the tensor, never added."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, Region]] = set()
    for qual, region, t in shards:
        if (qual, region) in seen:
            continue
        seen.add((qual, region))
        full = out.setdefault(qual, torch.zeros(region.shape, dtype=t.dtype))
        Region.full(region.shape).copy_into(full, region, t)
    return out


def create_groups(m: Materialized) -> ProcessGroups:
    """Every process group the program uses, created on every rank in the same order."""
    return ProcessGroups.create(groups_of([e.adapter for e in m.edges.values()], [m.reducer]))
