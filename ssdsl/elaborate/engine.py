"""The elaborator: runs a plan's statements and emits the flat directive list.

Expressions are evaluated directly on the AST (no intermediate code); selectors without
expressions inside are built once per AST node and shared, so a loop that makes 100,000
directives allocates little more than the directives themselves.

Errors of independent statements are all collected. A ``let`` that fails binds a *poisoned*
value: a later statement that reads it is skipped silently instead of reporting a second,
derived error.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable
from pathlib import Path as FsPath
from typing import Any

import attrs

from ssdsl.elaborate import directives as D
from ssdsl.elaborate import errors as E
from ssdsl.elaborate.loader import PlanLoader
from ssdsl.elaborate.resolve import suggest
from ssdsl.elaborate.values import (BUILTINS, MAX_MATERIALIZE, Range, convert, is_int, is_number,
                                    show, type_name)
from ssdsl.errors import ErrorGroup, SsdslError
from ssdsl.parse import Parsed
from ssdsl.parse import ast as A
from ssdsl.source import Span

DEFAULT_MAX_STEPS = 2_000_000
MAX_ERRORS = 50


class _Poisoned(Exception):
    """A statement read a name whose binding failed; its error was already reported."""


class _Abort(Exception):
    """Stop elaborating (too many errors, or the step limit)."""


_POISON = object()
_UNSET = object()
_ALL = D.All()


class _Frame:
    """Per plan instance: its file, and the selectors ``rest`` excludes."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.rest: list[D.Selector] = []


_ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod}
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
    ">": operator.gt, ">=": operator.ge}


class Elaborator:
    """One elaboration: shared state across the top plan and every plan it uses."""

    def __init__(self, *, world: int, loader: PlanLoader, max_steps: int) -> None:
        self.world = world
        self.loader = loader
        self.max_steps = max_steps
        self.steps = 0
        self.out: list[D.Directive] = []
        self.errors: list[SsdslError] = []
        self._seen: set[tuple] = set()
        self.stage_groups: dict[str, tuple[int, Span]] = {}
        self.meshes: dict[str, D.Mesh] = {}
        self.microbatches: int | None = None
        self.part_counts: list[int] = []
        self.stack: list[str] = []
        self.frame = _Frame("<plan>")
        self._free: dict[int, tuple[str, ...] | None] = {}
        self._sel_cache: dict[object, D.Selector] = {}
        self._stmt: dict[type, Callable[[Any, dict], None]] = {
            A.Let: self._let, A.Partition: self._partition, A.Replicate: self._replicate,
            A.Assign: self._assign, A.AssignEach: self._assign_each,
            A.OrderBefore: self._order_before, A.OrderSeq: self._order_seq,
            A.Microbatch: self._microbatch, A.Stages: self._stages, A.Recompute: self._recompute,
            A.Zero: self._zero, A.Mesh: self._mesh, A.Use: self._use, A.Require: self._require,
            A.For: self._for, A.If: self._if}
        self._expr: dict[type, Callable[[Any, dict], Any]] = {
            A.Num: lambda e, env: e.value, A.Str: lambda e, env: e.value,
            A.Bool: lambda e, env: e.value, A.Name: self._name, A.ListLit: self._list,
            A.RangeExpr: self._range, A.BinOp: self._binop, A.Unary: self._unary,
            A.Call: self._call, A.Index: self._index}

    # ============================================================ errors and limits
    def report(self, err: SsdslError) -> None:
        for e in (err.errors if isinstance(err, ErrorGroup) else [err]):
            key = (type(e), e.span, e.message)
            if key not in self._seen:
                self._seen.add(key)
                self.errors.append(e)
        if len(self.errors) >= MAX_ERRORS:
            raise _Abort

    def step(self, span: Span) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            self.report(E.TooManyDirectives(
                f"the plan makes more than {self.max_steps:,} directives and loop steps", span,
                hint="check the bounds of the loops"))
            raise _Abort

    def emit(self, directive: D.Directive) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            self.step(directive.span)
        self.out.append(directive)

    # ============================================================ plans
    def run_plan(self, parsed: Parsed, env: dict[str, Any]) -> None:
        """Run the body of ``parsed`` in ``env`` (parameters already bound)."""
        saved = self.frame
        self.frame = _Frame(parsed.file)
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
                env[p.name] = _POISON
                self.report(err)
            except _Poisoned:
                env[p.name] = _POISON
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
            except _Poisoned:
                pass

    def _let(self, s: A.Let, env: dict) -> None:
        env[s.name] = _POISON
        env[s.name] = self.ev(s.value, env)

    def _for(self, s: A.For, env: dict) -> None:
        it = self.ev(s.iter, env)
        if not isinstance(it, (Range, tuple)):
            raise E.WrongType(f"for needs a range or a list, got {type_name(it)} {show(it)}",
                              s.iter.span)
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
        n = self._count(s.count, env, "into")
        self.frame.rest.append(sel)
        self.part_counts.append(n)
        self.emit(D.Partition(sel, s.dim, n, s.span))

    def _replicate(self, s: A.Replicate, env: dict) -> None:
        sel = self.sel(s.selector, env)
        n = self._count(s.count, env, "into")
        self.frame.rest.append(sel)
        self.part_counts.append(n)
        self.emit(D.Replicate(sel, n, s.span))

    def _assign(self, s: A.Assign, env: dict) -> None:
        self.emit(D.Assign(self.sel(s.selector, env), self.place(s.place, env), s.span))

    def _assign_each(self, s: A.AssignEach, env: dict) -> None:
        base = self.sel(s.of, env) if s.of is not None else _ALL
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
            if len(s.vars) != 1 or len(counts) != 1:
                raise E.AmbiguousPartSpace(
                    "cannot tell the part indices: " + (
                        f"the plan partitions into {sorted(counts)}" if counts else
                        "nothing was partitioned or replicated before"), s.span,
                    hint="say them: assign each part (i, j) in [0..a, 0..b] to ...")
            return ((i,) for i in range(counts.pop()))
        space = self.ev(s.space, env)
        axes = [space] if len(s.vars) == 1 else space
        if not isinstance(axes, tuple) or len(axes) != len(s.vars):
            raise E.WrongArity(f"{len(s.vars)} index names need a list of {len(s.vars)} ranges",
                               s.space.span)
        for ax in axes:
            if not isinstance(ax, (Range, tuple)) or not all(is_int(i) and i >= 0 for i in ax):
                raise E.WrongType("a part index space is a range or a list of indices >= 0",
                                  s.space.span)
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
        n = self._count(s.count, env, "into")
        self.microbatches = n
        self.emit(D.Microbatch(s.dim, n, s.span))

    def _stages(self, s: A.Stages, env: dict) -> None:
        if s.name in self.stage_groups:
            raise E.DuplicateName(f"stage group '{s.name}' is already declared (at "
                                  f"{self.stage_groups[s.name][1]})", s.span)
        if s.count is not None:
            n, sels = self._count(s.count, env, "stages into"), ()
        else:
            sels = tuple(self.sel(x, env) for x in s.selectors)
            n = len(sels)
        self.stage_groups[s.name] = (n, s.span)
        self.emit(D.Stages(s.name, n, sels, s.span))

    def _recompute(self, s: A.Recompute, env: dict) -> None:
        self.emit(D.Recompute(self.sel(s.selector, env), s.span))

    def _zero(self, s: A.Zero, env: dict) -> None:
        sel = self.sel(s.selector, env) if s.selector is not None else _ALL
        self.emit(D.Zero(sel, self.place(s.place, env), s.span))

    def _mesh(self, s: A.Mesh, env: dict) -> None:
        if s.name in self.meshes:
            raise E.DuplicateName(f"mesh '{s.name}' is already declared (at "
                                  f"{self.meshes[s.name].span})", s.span)
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
        self.meshes[s.name] = mesh
        self.emit(mesh)

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
        inner = self.bind(parsed.plan, given, s.span)
        if len(self.errors) == before:  # a plan with unbound parameters would only cascade
            self.run_plan(parsed, inner)

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
    def _bool(self, e: A.Expr, env: dict, what: str) -> bool:
        v = self.ev(e, env)
        if not isinstance(v, bool):
            raise E.WrongType(f"{what} needs a bool, got {type_name(v)} {show(v)}", e.span)
        return v

    def _int(self, e: A.Expr, env: dict, what: str) -> int:
        v = self.ev(e, env)
        if not is_int(v):
            raise E.WrongType(f"{what} needs an int, got {type_name(v)} {show(v)}", e.span)
        return v

    def _count(self, e: A.Expr, env: dict, what: str) -> int:
        n = self._int(e, env, what)
        if n < 1:
            raise E.WrongValue(f"{what} needs a count of at least 1, got {n}", e.span)
        return n

    def _device(self, value: Any, span: Span) -> int:
        if not is_int(value):
            raise E.WrongType(f"a device is an int, got {type_name(value)} {show(value)}", span)
        if not 0 <= value < self.world:
            raise E.DeviceOutOfRange(f"device {value} is outside 0..{self.world} "
                                     f"(world is {self.world})", span,
                                     hint="run with more devices (--world N) or use fewer")
        return value

    def place(self, p: A.Place, env: dict) -> tuple[int, ...]:
        """The device ids of a place, in order."""
        if type(p) is A.PlaceDevice:
            d = self.ev(p.device, env)
            if type(d) is int and 0 <= d < self.world:
                return (d,)
            return (self._device(d, p.device.span),)
        if isinstance(p, A.PlaceDevices):
            value = self.ev(p.devices, env)
            if not isinstance(value, (Range, tuple)):
                raise E.WrongType(f"devices needs a list or a range, got {type_name(value)}",
                                  p.devices.span)
            if len(value) == 0:
                raise E.EmptyRange("this device list is empty", p.devices.span)
            ids = tuple(self._device(v, p.devices.span) for v in value)
            if len(set(ids)) != len(ids):
                raise E.DuplicateDevice("a device appears twice in this list", p.devices.span)
            return ids
        return self._mesh_place(p, env)

    def _mesh_place(self, p: A.PlaceMesh, env: dict) -> tuple[int, ...]:
        mesh = self.meshes.get(p.mesh)
        if mesh is None:
            raise E.UnknownMesh(f"unknown mesh '{p.mesh}'{suggest(p.mesh, self.meshes)}",
                                p.mesh_span, hint="declare it first: mesh NAME = grid(axis=N, ...)")
        names = [a for a, _ in mesh.axes]
        chosen: dict[str, int | None] = {}
        if p.coords and all(c.axis is None for c in p.coords):
            if len(p.coords) != len(names):
                raise E.WrongArity(f"mesh '{p.mesh}' has {len(names)} axes ({', '.join(names)}), "
                                   f"got {len(p.coords)} coordinates", p.span)
            for name, c in zip(names, p.coords):
                chosen[name] = self._coord(mesh, name, c, env)
        else:
            for c in p.coords:
                if c.axis is None:
                    raise E.WrongArity("give every mesh coordinate by position or every one by "
                                       "name", c.span)
                if c.axis not in names:
                    raise E.UnknownMeshAxis(f"mesh '{p.mesh}' has no axis '{c.axis}'"
                                            f"{suggest(c.axis, names)}", c.span)
                if c.axis in chosen:
                    raise E.DuplicateName(f"axis '{c.axis}' is given twice", c.span)
                chosen[c.axis] = self._coord(mesh, c.axis, c, env)
        return _mesh_devices(mesh, chosen)

    def _coord(self, mesh: D.Mesh, axis: str, c: A.MeshCoord, env: dict) -> int | None:
        if c.value is None:
            return None
        size = dict(mesh.axes)[axis]
        v = self.ev(c.value, env)
        if not is_int(v):
            raise E.WrongType(f"a mesh coordinate is an int, got {type_name(v)} {show(v)}", c.span)
        if not 0 <= v < size:
            raise E.IndexOutOfRange(f"coordinate {v} is outside 0..{size} of axis '{axis}'",
                                    c.span)
        return v

    def units(self, item: A.SeqItem, env: dict) -> list[D.WorkUnit]:
        """The units of work an order item denotes, in order."""
        if isinstance(item, A.Interleave):
            lists = [self.units(x, env) for x in item.items]
            out = []
            for group in itertools.zip_longest(*lists):
                out.extend(u for u in group if u is not None)
            return out
        sel = self.sel(item.selector, env)
        if item.pass_ is None:
            return [D.WorkUnit("op", sel, None)]
        if item.mb is None:
            mbs: Any = range(self.microbatches or 1)
        else:
            mbs = self.ev(item.mb, env)
            if is_int(mbs):
                mbs = (mbs,)
            elif not isinstance(mbs, (Range, tuple)):
                raise E.WrongType(f"mb needs an int, a range or a list, got {type_name(mbs)}",
                                  item.mb.span)
        count = self.microbatches or 1
        out = []
        for mb in mbs:
            if not is_int(mb) or not 0 <= mb < count:
                raise E.MicrobatchOutOfRange(
                    f"micro-batch {show(mb)} is outside 0..{count}", item.mb.span if item.mb
                    else item.span, hint="the plan's 'microbatch ... into N' sets the count"
                    if self.microbatches else "declare 'microbatch along batch into N' first")
            out.append(D.WorkUnit(item.pass_, sel, mb))
        return out

    # ============================================================ selectors
    def sel(self, s: A.Selector, env: dict) -> D.Selector:
        """The symbolic selector of ``s``.

        Selectors are cached by AST node and the values of the names they read, so the selector
        of ``h.{l}.mlp`` inside ``for i`` is built once per ``l``, not once per ``i``.
        """
        free = self._free.get(id(s), _UNSET)
        if free is _UNSET:
            # parts and stage references are cheap to build (their base is cached) and change
            # with the loop index, so caching them would only fill the cache
            free = None if type(s) in (A.SelPart, A.SelStage) else _free_names(s)
            self._free[id(s)] = free
        if free is None:  # also for ``rest``: its value depends on the statements before it
            return self._sel(s, env)
        if not free:
            key: object = id(s)
        elif len(free) == 1:
            key = (id(s), env.get(free[0], _POISON))
        else:
            key = (id(s), *[env.get(n, _POISON) for n in free])
        hit = self._sel_cache.get(key)
        if hit is None:
            hit = self._sel_cache[key] = self._sel(s, env)
        return hit

    def _sel(self, s: A.Selector, env: dict) -> D.Selector:
        if type(s) is A.SelPath:
            segs: list[D.Segment] = []
            for seg in s.segments:
                segs.extend(self._segment(seg, env))
            return D.Path(tuple(segs))
        if type(s) is A.SelBin:
            cls = {"|": D.Union, "&": D.Intersect, "except": D.Except}[s.op]
            return cls(self.sel(s.left, env), self.sel(s.right, env))
        if type(s) is A.SelAll:
            return _ALL
        if type(s) is A.SelRest:
            return D.Rest(tuple(self.frame.rest))
        if type(s) is A.SelKind:
            return D.Kind(s.kinds)
        if type(s) is A.SelStage:
            return self._stage_ref(s, env)
        return self._part(s, env)

    def _stage_ref(self, s: A.SelStage, env: dict) -> D.StageRef:
        group = self.stage_groups.get(s.group)
        if group is None:
            raise E.UnknownStageGroup(f"unknown stage group '{s.group}'"
                                      f"{suggest(s.group, self.stage_groups)}", s.group_span,
                                      hint="declare it first: stages into N as NAME")
        i = self._int(s.index, env, "a stage index")
        if not 0 <= i < group[0]:
            raise E.StageOutOfRange(f"stage {i} is outside 0..{group[0]} of '{s.group}'",
                                    s.index.span)
        return D.StageRef(s.group, i)

    def _part(self, s: A.SelPart, env: dict) -> D.PartOf:
        index = []
        for e in s.index:
            i = self.ev(e, env)
            if type(i) is not int:
                i = self._int(e, env, "a part index")
            if i < 0:
                raise E.IndexOutOfRange(f"a part index is >= 0, got {i}", e.span)
            index.append(i)
        return D.PartOf(tuple(index), self.sel(s.base, env))

    def _segment(self, seg: A.Segment, env: dict) -> list[D.Segment]:
        kind = seg.kind
        if kind == "name" or kind == "index":
            return [seg.value]
        if kind == "star":
            return ["*"]
        if kind == "starstar":
            return ["**"]
        if kind == "range":
            lo, hi, inclusive = seg.value
            return [_index_range(lo, hi + 1 if inclusive else hi, seg.span)]
        return _segments_of(self.ev(seg.value, env), seg.span)

    # ============================================================ expressions
    def ev(self, e: A.Expr, env: dict) -> Any:
        """The value of expression ``e``."""
        if type(e) is A.Name:  # the most frequent case, without the dispatch
            v = env.get(e.id, _POISON)
            if v is not _POISON:
                return v
        return self._expr[type(e)](e, env)

    def _name(self, e: A.Name, env: dict) -> Any:
        v = env.get(e.id, _POISON)
        if v is _POISON:
            if e.id in env:
                raise _Poisoned
            raise E.UnknownName(f"unknown name '{e.id}'{suggest(e.id, env)}", e.span)
        return v

    def _list(self, e: A.ListLit, env: dict) -> tuple:
        return tuple(self.ev(x, env) for x in e.items)

    def _range(self, e: A.RangeExpr, env: dict) -> Range:
        lo, hi = self.ev(e.lo, env), self.ev(e.hi, env)
        for v, sub in ((lo, e.lo), (hi, e.hi)):
            if not is_int(v):
                raise E.WrongType(f"a range bound is an int, got {type_name(v)} {show(v)}",
                                  sub.span)
        if e.inclusive:
            hi += 1
        if hi < lo:
            raise E.ReversedRange(f"the range {lo}..{hi} ends before it starts", e.span,
                                  hint="write the smaller bound first")
        if hi == lo and isinstance(e.lo, A.Num) and isinstance(e.hi, A.Num):
            raise E.EmptyRange(f"the range {lo}..{hi} is empty", e.span,
                               hint="a..b stops before b; a..=b includes b")
        return Range(lo, hi)

    def _unary(self, e: A.Unary, env: dict) -> Any:
        v = self.ev(e.operand, env)
        if e.op == "not":
            if not isinstance(v, bool):
                raise E.WrongType(f"'not' needs a bool, got {type_name(v)} {show(v)}",
                                  e.operand.span)
            return not v
        if not is_number(v):
            raise E.WrongType(f"'-' needs a number, got {type_name(v)} {show(v)}", e.operand.span)
        return -v

    def _binop(self, e: A.BinOp, env: dict) -> Any:
        op = e.op
        if op == "and" or op == "or":
            left = self._bool(e.left, env, f"'{op}'")
            if (op == "and") != left:
                return left
            return self._bool(e.right, env, f"'{op}'")
        a, b = self.ev(e.left, env), self.ev(e.right, env)
        if op in _COMPARE:
            return self._compare(e, a, b)
        return self._arith(e, a, b)

    def _compare(self, e: A.BinOp, a: Any, b: Any) -> bool:
        ordered = e.op not in ("==", "!=")
        same = (is_number(a) and is_number(b)) or type_name(a) == type_name(b)
        if not same or (ordered and not (is_number(a) or isinstance(a, str))):
            raise E.WrongType(f"cannot compare {type_name(a)} {show(a)} {e.op} {type_name(b)} "
                              f"{show(b)}", e.span)
        return _COMPARE[e.op](a, b)

    def _arith(self, e: A.BinOp, a: Any, b: Any) -> Any:
        op = e.op
        if not (is_number(a) and is_number(b)):
            if op == "+" and type_name(a) == type_name(b) and isinstance(a, (str, tuple)):
                if len(a) + len(b) > MAX_MATERIALIZE:
                    raise E.WrongValue("this value grows too large", e.span)
                return a + b
            raise E.WrongType(f"cannot apply {op} to {type_name(a)} {show(a)} and "
                              f"{type_name(b)} {show(b)}", e.span)
        if op in ("/", "//", "%") and b == 0:
            raise E.DivisionByZero(f"division by zero ({show(a)} {op} {show(b)})", e.right.span)
        try:
            result = _ARITH[op](a, b)
        except (OverflowError, ValueError) as exc:
            raise E.ArithmeticFault(f"cannot compute {op}: {exc}", e.span) from None
        if isinstance(result, int) and result.bit_length() > 256:
            raise E.ArithmeticFault("this integer is too large", e.span)
        return result

    def _call(self, e: A.Call, env: dict) -> Any:
        entry = BUILTINS.get(e.func)
        if entry is None:
            raise E.UnknownFunction(f"unknown function '{e.func}'", e.func_span)
        values = [self.ev(a.value, env) for a in e.args]
        try:
            return entry[2](values, [a.span for a in e.args], e.span)
        except (OverflowError, ValueError) as exc:
            raise E.ArithmeticFault(f"{e.func}(): {exc}", e.span) from None

    def _index(self, e: A.Index, env: dict) -> Any:
        base, i = self.ev(e.base, env), self.ev(e.index, env)
        if not isinstance(base, (tuple, Range, str)):
            raise E.WrongType(f"cannot index {type_name(base)} {show(base)}", e.base.span)
        if not is_int(i):
            raise E.WrongType(f"an index is an int, got {type_name(i)} {show(i)}", e.index.span)
        if not 0 <= i < len(base):
            raise E.IndexOutOfRange(f"index {i} is outside 0..{len(base)}", e.index.span)
        return base.lo + i if isinstance(base, Range) else base[i]


# ================================================================ helpers


def _params_hint(plan: A.Plan) -> str:
    if not plan.params:
        return f"plan '{plan.name}' takes no parameters"
    return "parameters: " + ", ".join(f"{p.name}: {p.type}" for p in plan.params)


def _index_range(lo: int, hi: int, span: Span) -> D.IndexRange:
    if hi < lo:
        raise E.ReversedRange(f"the index range {lo}..{hi} ends before it starts", span,
                              hint="write the smaller index first")
    if hi == lo:
        raise E.EmptyRange(f"the index range {lo}..{hi} selects nothing", span,
                           hint="a..b stops before b; a..=b includes b")
    return D.IndexRange(lo, hi)


def _segments_of(value: Any, span: Span) -> list[D.Segment]:
    """Path segments from the value of a ``{expr}`` segment."""
    if is_int(value):
        if value < 0:
            raise E.WrongValue(f"a path index is >= 0, got {value}", span)
        return [value]
    if isinstance(value, Range):
        return [_index_range(value.lo, value.hi, span)]
    if isinstance(value, str):
        return [_text_segment(piece, span) for piece in _SINGLE_DOT.split(value)]
    raise E.WrongType(f"a path segment is an int, a range or a str, got {type_name(value)} "
                      f"{show(value)}", span)


_SINGLE_DOT = re.compile(r"(?<!\.)\.(?![.=])")


def _text_segment(piece: str, span: Span) -> D.Segment:
    if piece in ("*", "**"):
        return piece
    if piece.isdigit():
        return int(piece)
    if ".." in piece:
        lo, _, hi = piece.partition("..")
        inclusive = hi.startswith("=")
        hi = hi[1:] if inclusive else hi
        if lo.isdigit() and hi.isdigit():
            return _index_range(int(lo), int(hi) + inclusive, span)
    if piece.isidentifier():
        return piece
    raise E.WrongValue(f"'{piece}' is not a module path segment", span,
                       hint="segments are names, indices, a..b, * or **")


def _mesh_devices(mesh: D.Mesh, chosen: dict[str, int | None]) -> tuple[int, ...]:
    """Devices of a mesh at the chosen coordinates; free axes in row-major order."""
    ranges = [range(n) if chosen.get(a) is None else (chosen[a],) for a, n in mesh.axes]
    sizes = [n for _, n in mesh.axes]
    out = []
    for coord in itertools.product(*ranges):
        flat = 0
        for c, n in zip(coord, sizes):
            flat = flat * n + c
        out.append(mesh.devices[flat])
    return tuple(out)


def _free_names(s: A.Selector) -> tuple[str, ...] | None:
    """The names a selector's expressions read (sorted), or None when it contains ``rest``."""
    names: set[str] = set()
    stack: list[object] = [s]
    while stack:
        node = stack.pop()
        if isinstance(node, A.SelRest):
            return None
        if isinstance(node, A.Name):
            names.add(node.id)
        elif isinstance(node, tuple):
            stack.extend(node)
        elif attrs.has(type(node)) and not isinstance(node, Span):
            stack.extend(getattr(node, f.name) for f in attrs.fields(type(node)))
    return tuple(sorted(names))
