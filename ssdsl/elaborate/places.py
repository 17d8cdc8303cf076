"""Where and what: places (device ids), units of work, and selectors of the plan language.

``Places`` extends the expression evaluator with what statements need to name devices and
operators. Selectors stay symbolic (``ssdsl.elaborate.directives``); they are cached by AST node
and the values of the names they read, so ``h.{l}.mlp`` inside ``for i`` is built once per ``l``.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import attrs

from ssdsl.elaborate import directives as D
from ssdsl.elaborate import errors as E
from ssdsl.elaborate.evaluate import POISON, POISON_COUNT, Evaluator, Poisoned
from ssdsl.elaborate.resolve import suggest
from ssdsl.elaborate.values import Range, is_int, show, type_name
from ssdsl.parse import ast as A
from ssdsl.source import Span

ALL = D.All()
_UNSET = object()


class Frame:
    """Per plan instance: its file, and the selectors ``rest`` excludes."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.rest: list[D.Selector] = []


class Places(Evaluator):
    """Devices, units and selectors; the state they read is set up by the elaborator."""

    def __init__(self, *, world: int) -> None:
        super().__init__()
        self.world = world
        self.stage_groups: dict[str, tuple[int, Span]] = {}
        self.meshes: dict[str, D.Mesh] = {}
        self.microbatches: int | None = None
        self.poisoned: set[str] = set()  # stage groups and meshes whose declaration failed
        self.frame = Frame("<plan>")
        self._free: dict[int, tuple[str, ...] | None] = {}
        self._sel_cache: dict[object, D.Selector] = {}

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
                raise E.EmptyRange("this device list is empty", p.devices.span,
                                   hint="give at least one device: devices [0, 1] or 0..n")
            ids = tuple(self._device(v, p.devices.span) for v in value)
            if len(set(ids)) != len(ids):
                twice = next(d for d in ids if ids.count(d) > 1)
                raise E.DuplicateDevice(f"device {twice} appears twice in this list",
                                        p.devices.span, hint="name each device once (a spread "
                                        "puts one part on each device of the list)")
            return ids
        return self._mesh_place(p, env)

    def _mesh_place(self, p: A.PlaceMesh, env: dict) -> tuple[int, ...]:
        mesh = self.meshes.get(p.mesh)
        if mesh is None and p.mesh in self.poisoned:
            raise Poisoned
        if mesh is None:
            raise E.UnknownMesh(f"unknown mesh '{p.mesh}'{suggest(p.mesh, self.meshes)}",
                                p.mesh_span, hint="declare it first: mesh NAME = grid(axis=N, ...)")
        names = [a for a, _ in mesh.axes]
        chosen: dict[str, int | None] = {}
        if p.coords and all(c.axis is None for c in p.coords):
            if len(p.coords) != len(names):
                raise E.WrongArity(f"mesh '{p.mesh}' has {len(names)} axes ({', '.join(names)}), "
                                   f"got {len(p.coords)} coordinates", p.span,
                                   hint=f"give one coordinate per axis, or leave axes out by "
                                        f"name: {p.mesh}[{names[0]}=0]")
            for name, c in zip(names, p.coords):
                chosen[name] = self._coord(mesh, name, c, env)
        else:
            for c in p.coords:
                if c.axis is None:
                    raise E.WrongArity("give every mesh coordinate by position or every one by "
                                       "name", c.span,
                                       hint=f"by name: {p.mesh}["
                                            f"{', '.join(f'{a}=...' for a in names)}]")
                if c.axis not in names:
                    raise E.UnknownMeshAxis(f"mesh '{p.mesh}' has no axis '{c.axis}'"
                                            f"{suggest(c.axis, names)}", c.span,
                                            hint=f"its axes: {', '.join(names)}")
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
                                    c.span, hint=f"axis '{axis}' of mesh '{mesh.name}' has "
                                    f"{size} coordinates, 0 to {size - 1}")
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
        if self.microbatches == POISON_COUNT:
            raise Poisoned
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
            key = (id(s), env.get(free[0], POISON))
        else:
            key = (id(s), *[env.get(n, POISON) for n in free])
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
            return ALL
        if type(s) is A.SelRest:
            return D.Rest(tuple(self.frame.rest))
        if type(s) is A.SelKind:
            return D.Kind(s.kinds)
        if type(s) is A.SelStage:
            return self._stage_ref(s, env)
        return self._part(s, env)

    def _stage_ref(self, s: A.SelStage, env: dict) -> D.StageRef:
        group = self.stage_groups.get(s.group)
        if group is None and s.group in self.poisoned:
            raise Poisoned
        if group is None:
            raise E.UnknownStageGroup(f"unknown stage group '{s.group}'"
                                      f"{suggest(s.group, self.stage_groups)}", s.group_span,
                                      hint="declare it first: stages into N as NAME")
        i = self._int(s.index, env, "a stage index")
        if not 0 <= i < group[0]:
            raise E.StageOutOfRange(f"stage {i} is outside 0..{group[0]} of '{s.group}'",
                                    s.index.span, hint=f"'{s.group}' has {group[0]} stage"
                                    f"{'s' if group[0] > 1 else ''}: {s.group}[0] to "
                                    f"{s.group}[{group[0] - 1}] (declared at {group[1]})")
        return D.StageRef(s.group, i)

    def _part(self, s: A.SelPart, env: dict) -> D.PartOf:
        index = []
        for e in s.index:
            i = self.ev(e, env)
            if type(i) is not int:
                i = self._int(e, env, "a part index")
            if i < 0:
                raise E.IndexOutOfRange(f"a part index is >= 0, got {i}", e.span,
                                        hint="the parts of N are numbered 0 to N - 1")
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
            raise E.WrongValue(f"a path index is >= 0, got {value}", span,
                               hint="module indices count from 0, as in h.0")
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

