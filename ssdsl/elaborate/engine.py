"""The elaborator: runs a plan's statements and emits the flat directive list.

Statements live here; expressions are in ``evaluate`` and places, units and selectors in
``places``, which this class extends. Expressions are evaluated directly on the AST (no
intermediate code) and selectors are cached, so a loop that makes 100,000 directives allocates
little more than the directives themselves.

Errors of independent statements are all collected. A ``let`` that fails binds a *poisoned*
value: a later statement that reads it is skipped silently instead of reporting a second,
derived error.
"""

from __future__ import annotations

import itertools

import attrs
from collections.abc import Callable
from pathlib import Path as FsPath
from typing import Any, NoReturn

from ssdsl.elaborate import directives as D
from ssdsl.elaborate import errors as E
from ssdsl.elaborate.evaluate import MAX_COUNT, POISON, POISON_COUNT, Poisoned
from ssdsl.elaborate.loader import PlanLoader
from ssdsl.elaborate.places import ALL, Frame, Places
from ssdsl.elaborate.resolve import suggest
from ssdsl.elaborate.values import Range, convert, is_int, show, type_name
from ssdsl.errors import ErrorGroup, SsdslError
from ssdsl.parse import Parsed
from ssdsl.parse import ast as A
from ssdsl.source import Span

DEFAULT_MAX_STEPS = 2_000_000
MAX_ERRORS = 50


class _Abort(Exception):
    """Stop elaborating (too many errors, or the step limit)."""


class _StopUse(Exception):
    """Stop running a used plan after its first error: what follows in it builds on what failed."""


class Elaborator(Places):
    """One elaboration: shared state across the top plan and every plan it uses."""

    def __init__(self, *, world: int, loader: PlanLoader, max_steps: int) -> None:
        super().__init__(world=world)
        self.loader = loader
        self.max_steps = max_steps
        self.steps = 0
        self.out: list[D.Directive] = []
        self.errors: list[SsdslError] = []
        self._seen: set[tuple] = set()
        self.part_counts: list[int] = []
        self.stack: list[str] = []
        self.via: Span | None = None  # the `use` statement the running plan was reached through
        self.microbatch_span: Span | None = None
        self._stmt: dict[type, Callable[[Any, dict], None]] = {
            A.Let: self._let, A.Partition: self._partition, A.Replicate: self._replicate,
            A.Assign: self._assign, A.AssignEach: self._assign_each,
            A.OrderBefore: self._order_before, A.OrderSeq: self._order_seq,
            A.Microbatch: self._microbatch, A.Stages: self._stages, A.Recompute: self._recompute,
            A.Zero: self._zero, A.Mesh: self._mesh, A.Use: self._use, A.Require: self._require,
            A.For: self._for, A.If: self._if}

    # ============================================================ errors and limits
    def report(self, err: SsdslError, *, stop_use: bool = True) -> None:
        for e in (err.errors if isinstance(err, ErrorGroup) else [err]):
            if e.span is not None and self.via is not None and e.span.file == self.stack[-1]:
                e.span = e.span.reached_via(self.via)
            key = (type(e), e.span, e.message)
            if key not in self._seen:
                self._seen.add(key)
                self.errors.append(e)
        if len(self.errors) >= MAX_ERRORS:
            raise _Abort
        if stop_use and self.via is not None:
            raise _StopUse

    def step(self, span: Span) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            self.too_many(span)

    def too_many(self, span: Span) -> NoReturn:
        self.report(E.TooManyDirectives(
            f"the plan makes more than {self.max_steps:,} directives and loop steps", span,
            hint="check the bounds of the loops"), stop_use=False)
        raise _Abort

    def emit(self, directive: D.Directive) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            self.too_many(directive.span)
        if self.via is not None:  # later phases' errors then name the user's `use` line
            directive = attrs.evolve(directive, span=directive.span.reached_via(self.via))
        self.out.append(directive)

    # ============================================================ plans
    def run_plan(self, parsed: Parsed, env: dict[str, Any]) -> None:
        """Run the body of ``parsed`` in ``env`` (parameters already bound)."""
        saved = self.frame
        self.frame = Frame(parsed.file)
        self.stack.append(parsed.file)
        try:
            self.block(parsed.plan.body, env)
        finally:
            self.stack.pop()
            self.frame = saved

    def bind(self, plan: A.Plan, given: dict[str, tuple[Any, Span | None]],
             call_span: Span | None) -> dict[str, Any]:
        """Bind the parameters: given values (already language values), else defaults."""
        env: dict[str, Any] = {"world": self.world}
        declared = {p.name for p in plan.params}
        for name, (_, span) in given.items():
            if name not in declared:
                self.report(E.UnknownParameter(
                    f"plan '{plan.name}' has no parameter '{name}'{suggest(name, declared)}",
                    span or plan.name_span, hint=_params_hint(plan)))
        for p in plan.params:
            try:
                env[p.name] = self._param_value(p, given, env, call_span, plan)
            except SsdslError as err:
                env[p.name] = POISON
                self.report(err)
            except Poisoned:
                env[p.name] = POISON
        return env

    def _param_value(self, p: A.Param, given, env, call_span, plan) -> Any:
        if p.name in given:
            value, span = given[p.name]
            where = span or p.span
        elif p.default is not None:
            value, where = self.ev(p.default, env), p.default.span
        else:
            raise E.MissingParameter(f"plan '{plan.name}' needs a value for parameter '{p.name}'",
                                     call_span or p.span, hint=f"give {p.name}=... "
                                     f"({'--set' if call_span is None else 'an argument'})")
        conv = convert(value, p.type)
        if conv is None:
            raise E.WrongType(f"parameter '{p.name}' is {p.type}, got {type_name(value)} "
                              f"{show(value)}", where)
        return conv

    # ============================================================ statements
    def block(self, stmts: tuple[A.Stmt, ...], env: dict[str, Any]) -> None:
        handlers = self._stmt
        for s in stmts:
            try:
                handlers[type(s)](s, env)
            except SsdslError as err:
                self.report(err)
            except Poisoned:
                pass

    def _let(self, s: A.Let, env: dict) -> None:
        env[s.name] = POISON
        env[s.name] = self.ev(s.value, env)

    def _for(self, s: A.For, env: dict) -> None:
        it = self.ev(s.iter, env)
        if not isinstance(it, (Range, tuple)):
            raise E.WrongType(f"for needs a range or a list, got {type_name(it)} {show(it)}",
                              s.iter.span)
        # a range's count by subtraction: len() refuses one over 2**63 - 1 (-big..big)
        count = max(0, it.hi - it.lo) if isinstance(it, Range) else len(it)
        if count > self.max_steps - self.steps:
            # each step of the loop counts: one that cannot fit is refused before it runs (a
            # loop of millions would otherwise run until it crossed the bound)
            self.too_many(s.header_span)
        for value in it:
            self.step(s.header_span)
            inner = dict(env)
            inner[s.var] = value
            self.block(s.body, inner)

    def _if(self, s: A.If, env: dict) -> None:
        for cond, body, _ in s.branches:
            if self._bool(cond, env, "if"):
                self.block(body, dict(env))
                return
        if s.orelse is not None:
            self.block(s.orelse, dict(env))

    def _require(self, s: A.Require, env: dict) -> None:
        if self._bool(s.cond, env, "require"):
            return
        msg = self.ev(s.message, env) if s.message is not None else None
        text = msg if isinstance(msg, str) else "the requirement of this line does not hold"
        raise E.RequirementFailed(text, s.span)

    def _partition(self, s: A.Partition, env: dict) -> None:
        sel = self.sel(s.selector, env)
        n = self._parts_count(s.count, env, "partition into")
        self.frame.rest.append(sel)
        self.part_counts.append(n)
        self.emit(D.Partition(sel, s.dim, n, s.span))

    def _replicate(self, s: A.Replicate, env: dict) -> None:
        sel = self.sel(s.selector, env)
        n = self._parts_count(s.count, env, "replicate into", limit=self.world,
                        limit_why=f"copies go one per device, and world is {self.world}")
        self.frame.rest.append(sel)
        self.part_counts.append(n)
        self.emit(D.Replicate(sel, n, s.span))

    def _parts_count(self, e: A.Expr, env: dict, what: str, **limits: Any) -> int:
        """A partition's or replication's count; when it fails, an ``assign each part`` that
        would infer its indices from it is skipped rather than reported as a second error."""
        try:
            return self._count(e, env, what, **limits)
        except (SsdslError, Poisoned):
            self.part_counts.append(POISON_COUNT)
            raise

    def _assign(self, s: A.Assign, env: dict) -> None:
        self.emit(D.Assign(self.sel(s.selector, env), self.place(s.place, env), s.span))

    def _assign_each(self, s: A.AssignEach, env: dict) -> None:
        base = self.sel(s.of, env) if s.of is not None else ALL
        space = self._part_space(s, env)
        inner = dict(env)
        for index in space:
            inner.update(zip(s.vars, index))
            devices = self.place(s.place, inner)
            if len(devices) != 1:
                raise E.WrongValue(f"each part goes to one device, this place has {len(devices)}",
                                   s.place.span, hint="use 'device N' or a full mesh coordinate")
            self.emit(D.Assign(D.PartOf(index, base), devices, s.span))

    def _part_space(self, s: A.AssignEach, env: dict) -> Any:
        if s.space is None:
            counts = set(self.part_counts)
            if POISON_COUNT in counts:
                raise Poisoned
            if len(s.vars) != 1 or len(counts) != 1:
                raise E.AmbiguousPartSpace(
                    "cannot tell the part indices: " + (
                        f"the plan partitions into {sorted(counts)}" if counts else
                        "nothing was partitioned or replicated before"), s.span,
                    hint="say them: assign each part (i, j) in [0..a, 0..b] to ...")
            return ((i,) for i in range(counts.pop()))
        space = self.ev(s.space, env)
        axes = (space,) if len(s.vars) == 1 else space
        if not isinstance(axes, tuple) or len(axes) != len(s.vars):
            raise E.WrongArity(f"{len(s.vars)} index names need a list of {len(s.vars)} ranges",
                               s.space.span)
        for ax in axes:
            ok = (isinstance(ax, Range) and ax.lo >= 0) or (
                isinstance(ax, tuple) and all(is_int(i) and i >= 0 for i in ax))
            if not ok:
                raise E.WrongType("a part index space is a range or a list of indices >= 0",
                                  s.space.span)
            if _largest(ax) >= MAX_COUNT:
                raise E.CountTooLarge(f"part index {_largest(ax):,} is beyond the limit of "
                                      f"counts ({MAX_COUNT:,} parts)", s.space.span)
        return itertools.product(*axes)

    def _order_before(self, s: A.OrderBefore, env: dict) -> None:
        units = []
        for u in s.units:
            expanded = self.units(u, env)
            if len(expanded) != 1:
                raise E.OrderUnitArity(f"'before' needs one unit of work on each side, this "
                                       f"denotes {len(expanded)}", u.span,
                                       hint="give one micro-batch (mb N), or use 'order on device'")
            units.append(expanded[0])
        for a, b in zip(units, units[1:]):
            self.emit(D.OrderBefore(a, b, s.span))

    def _order_seq(self, s: A.OrderSeq, env: dict) -> None:
        devices = self.place(s.place, env)
        units: list[D.WorkUnit] = []
        for line in s.lines:
            for item in line:
                units.extend(self.units(item, env))
        if units:
            self.emit(D.OrderSequence(devices, tuple(units), s.span))

    def _microbatch(self, s: A.Microbatch, env: dict) -> None:
        first = self.microbatch_span
        if first is not None:
            raise E.DuplicateStatement(
                "the plan already splits the batch into micro-batches", s.span,
                hint=f"the first microbatch statement is at {first}"
                     f"{_via_text(first)}; a plan has one")
        self.microbatch_span = s.span.reached_via(self.via)
        try:
            n = self._count(s.count, env, "microbatch into")
        except SsdslError:
            self.microbatches = POISON_COUNT  # later `mb` references are not errors of their own
            raise
        self.microbatches = n
        self.emit(D.Microbatch(s.dim, n, s.span))

    def _stages(self, s: A.Stages, env: dict) -> None:
        if s.name in self.stage_groups:
            first = self.stage_groups[s.name][1]
            raise E.DuplicateName(f"stage group '{s.name}' is already declared (at "
                                  f"{first}{_via_text(first)})", s.span)
        try:
            over = self.sel(s.over, env) if s.over is not None else None
            if s.count is not None:
                n, sels = self._count(s.count, env, "stages into"), ()
            else:
                sels = tuple(self.sel(x, env) for x in s.selectors)
                splits = tuple(1 if e is None else self._count(e, env, "stages ... into")
                               for e in s.splits)
                n = sum(splits) if splits else len(sels)
        except (SsdslError, Poisoned):
            self.poisoned.add(s.name)  # `st[i]` later is not an error of its own
            raise
        self.stage_groups[s.name] = (n, s.span.reached_via(self.via))
        self.emit(D.Stages(s.name, n, sels, s.span, over=over,
                           splits=splits if s.count is None else ()))

    def _recompute(self, s: A.Recompute, env: dict) -> None:
        self.emit(D.Recompute(self.sel(s.selector, env), s.span))

    def _zero(self, s: A.Zero, env: dict) -> None:
        sel = self.sel(s.selector, env) if s.selector is not None else ALL
        stage = self._int(s.stage, env, "zero stage") if s.stage is not None else 1
        if stage not in D.ZERO_STAGES:
            raise E.WrongValue(f"zero stage {stage} does not exist", s.stage.span,
                               hint="stage 1 shards the optimizer state, 2 also the gradients, "
                               "3 also the parameters")
        self.emit(D.Zero(sel, self.place(s.place, env), s.span, stage=stage))

    def _mesh(self, s: A.Mesh, env: dict) -> None:
        if s.name in self.meshes:
            first = self.meshes[s.name].span
            raise E.DuplicateName(f"mesh '{s.name}' is already declared (at "
                                  f"{first}{_via_text(first)})", s.span)
        try:
            self._declare_mesh(s, env)
        except (SsdslError, Poisoned):
            self.poisoned.add(s.name)  # `m[...]` later is not an error of its own
            raise

    def _declare_mesh(self, s: A.Mesh, env: dict) -> None:
        axes, seen = [], set()
        for ax in s.axes:
            if ax.name in seen:
                raise E.DuplicateName(f"mesh axis '{ax.name}' appears twice", ax.span)
            seen.add(ax.name)
            axes.append((ax.name, self._count(ax.size, env, "a mesh axis size")))
        origin = self._int(s.origin, env, "from") if s.origin is not None else 0
        size = 1
        for _, n in axes:
            size *= n
        if origin < 0 or origin + size > self.world:
            raise E.DeviceOutOfRange(f"mesh '{s.name}' needs devices {origin}..{origin + size}, "
                                     f"but world is {self.world}", s.span,
                                     hint="make the mesh smaller or run with more devices "
                                          "(--world N)")
        mesh = D.Mesh(s.name, tuple(axes), tuple(range(origin, origin + size)), s.span)
        self.emit(mesh)
        self.meshes[s.name] = self.out[-1]

    def _use(self, s: A.Use, env: dict) -> None:
        current = self.stack[-1] if self.stack else None
        path = self.loader.find(s.target, is_path=s.is_path, relative_to=current,
                                span=s.target_span)
        if path in self.stack:
            chain = " -> ".join(FsPath(p).name for p in self.stack[self.stack.index(path):])
            raise E.RecursiveUse(f"plan uses itself: {chain} -> {FsPath(path).name}", s.span,
                                 hint="remove the use that closes the cycle")
        parsed = self.loader.load(path)
        given = self._use_args(s, parsed.plan, env)
        before = len(self.errors)
        outer, site = self.via, s.span.reached_via(self.via)
        self.via = site
        self.stack.append(path)
        try:
            inner = self.bind(parsed.plan, given, s.span)
        except _StopUse:
            return
        finally:
            self.stack.pop()
            self.via = outer
        if len(self.errors) != before:  # a plan with unbound parameters would only cascade
            return
        self.via = site
        try:
            self.run_plan(parsed, inner)
        except _StopUse:
            pass
        finally:
            self.via = outer

    def _use_args(self, s: A.Use, plan: A.Plan, env: dict) -> dict[str, tuple[Any, Span]]:
        given: dict[str, tuple[Any, Span]] = {}
        names = [p.name for p in plan.params]
        for i, arg in enumerate(s.args):
            if arg.name is None:
                if i >= len(names):
                    raise E.WrongArity(f"plan '{plan.name}' takes {len(names)} parameters", arg.span)
                name = names[i]
            else:
                name = arg.name
            if name in given:
                raise E.DuplicateParameter(f"parameter '{name}' is given twice", arg.span)
            given[name] = (self.ev(arg.value, env), arg.span)
        return given

    # ============================================================ values for statements
# ================================================================ helpers


def _largest(ax: Range | tuple) -> int:
    if isinstance(ax, Range):
        return ax.hi - 1
    return max(ax, default=-1)


def _via_text(span: Span) -> str:
    return f", in the plan used at {span.via}" if span.via is not None else ""


def _params_hint(plan: A.Plan) -> str:
    if not plan.params:
        return f"plan '{plan.name}' takes no parameters"
    return "parameters: " + ", ".join(f"{p.name}: {p.type}" for p in plan.params)


