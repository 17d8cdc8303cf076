"""Prebuilt handlers: what an instruction does, worked out once per program instead of per step.

A step of a small model spends as long in the interpreter's own Python (binding a call's slots,
re-deriving a region's slices, dispatching by name) as in its ATen calls. ``prebuild(runner,
ins)`` returns a closure that does exactly what ``runner.on_<kind>(ins)`` does, with everything
that depends only on the instruction computed here: the ATen overload, which argument positions
take which values, the narrowing of a batch input, the leaf a weight's shard is. ``Runner.visit`` keeps one per instruction.

A closure meets a case it was not built for (a call that raises, a batch of another shape) by
handing the instruction to the ordinary handler, which then does the whole of it: what runs is
always what the handler would run.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from ssdsl.ir.graph import writes_in_place
from ssdsl.ir.interpret import resolve_target
from ssdsl.ir.region import Region
from ssdsl.ops.core import Slot, _map_slots

Handler = Callable[[Any], Any]

# True calls an ATen overload's own callable (``OpOverload._op``) rather than the overload object
# (benchmarks compare)
DIRECT = True
# True calls torch's own Python binding of an ATen operator (``torch._C._nn.linear``,
# ``torch._C._VariableFunctions.transpose``) where every call of the instruction
# reaches the traced overload through it (``fast_binding``): its argument parser is generated C++,
# about a microsecond a call cheaper than an overload's schema matching
BINDINGS = True
# True runs the overload as well after each call through a binding and raises where the two
# differ in value, dtype, shape or strides (tests; SSDSL_CHECK_BINDINGS=1 turns it on in ranks)
CHECK_BINDINGS = os.environ.get("SSDSL_CHECK_BINDINGS") == "1"



def _tensor_overloads(packet: Any) -> dict[str, Any]:
    """The overloads of ``packet`` that take a tensor and write no ``out=`` (TorchScript's
    scalar and list overloads, ``add.int`` and the like, are not reachable with tensors)."""
    out = {}
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        args = schema.arguments
        if any(a.is_out or (a.alias_info is not None and a.alias_info.is_write) for a in args):
            continue
        if any("Tensor" in str(a.type) for a in args):
            out[name] = schema
    return out


def _positional(schema: Any) -> tuple[int, int]:
    """(required, all) positional arguments of ``schema``."""
    pos = [a for a in schema.arguments if not a.kwarg_only]
    return sum(1 for a in pos if not a.has_default_value()), len(pos)


def _kind(arg: Any) -> str:
    """What a Python value must be to bind ``arg``, coarsely: a dtype, a name, or anything else."""
    real = str(getattr(arg, "real_type", arg.type))
    if "ScalarType" in real:
        return "dtype"
    if real in ("str", "Dimname", "Optional[str]", "List[str]"):
        return "name"
    return "value"


def _reaches(ours: str, schemas: dict[str, Any], npos: int, kwargs: frozenset[str]) -> bool:
    """Whether every call with ``npos`` positional arguments and keywords ``kwargs`` that binds
    overload ``ours`` also binds it among all of ``schemas`` (so a binding that tries them all,
    as torch's argument parser does, takes ``ours``): each other overload is told apart by the
    number of positional arguments, by a keyword one of them lacks, or by a dtype or a name where ours
    takes something else; ``X.Scalar`` is ``X.Tensor`` with the scalar wrapped (ATen's rule),
    so it may stand in for ``X.Tensor``."""
    mine = schemas[ours]
    for name, schema in schemas.items():
        if name == ours or (ours == "Tensor" and name == "Scalar"):
            continue
        lo, hi = _positional(schema)
        if not lo <= npos <= hi:
            continue
        keywords = [a for a in schema.arguments if a.kwarg_only]
        if not kwargs <= {a.name for a in keywords}:
            continue  # we pass a keyword it lacks
        if any(not a.has_default_value() and a.name not in kwargs for a in keywords):
            continue  # it needs a keyword we do not pass
        pos_mine = [a for a in mine.arguments if not a.kwarg_only][:npos]
        pos_other = [a for a in schema.arguments if not a.kwarg_only][:npos]
        if any(_kind(a) != _kind(b) and "value" in (_kind(a), _kind(b)) or
               {_kind(a), _kind(b)} == {"dtype", "name"} for a, b in zip(pos_mine, pos_other)):
            continue
        return False
    return True


def _number_for_a_tensor(schemas: dict[str, Any], ours: str) -> bool:
    """Whether ``ours`` takes a number where another overload takes a tensor: torch's parser
    settles that by its own signatures, deprecated ones included (``torch.add(x, 2, 0.5)`` binds
    ``add(Tensor, Number alpha, Tensor other)``), which the schemas do not show."""
    mine = [a for a in schemas[ours].arguments if not a.kwarg_only]
    for name, schema in schemas.items():
        if name == ours:
            continue
        other = [a for a in schema.arguments if not a.kwarg_only]
        if any(str(a.type) in ("Scalar", "number", "float", "int", "complex")
               and "Tensor" in str(b.type) for a, b in zip(mine, other)):
            return True
    return False


@functools.cache
def fast_binding(overload: Any) -> Callable | None:
    """torch's Python binding of ATen ``overload`` when every call of it that passes all of the
    schema's arguments (``explicit``) reaches ``overload`` through it, else None (worked out once
    per overload). The binding is the generated function of ``torch._C._nn`` or
    ``torch._C._VariableFunctions``, which takes the schema's arguments in the schema's order
    (tensor methods need not: ``Tensor.to``); its defaults may differ from the schema's
    (``cross_entropy_loss``'s reduction), so none is left to it."""
    if getattr(overload, "namespace", None) != "aten":
        return None
    packet = overload.overloadpacket
    name = packet.__name__
    found = [getattr(mod, name) for mod in (torch._C._nn, torch._C._VariableFunctions)
             if hasattr(mod, name)]
    if len(found) != 1 or not callable(found[0]):
        return None
    schemas = _tensor_overloads(packet)
    ours = overload._overloadname
    if ours not in schemas:
        return None
    if _number_for_a_tensor(schemas, ours):
        return None
    args = schemas[ours].arguments
    npos = sum(1 for a in args if not a.kwarg_only)
    keywords = frozenset(a.name for a in args if a.kwarg_only)
    return found[0] if _reaches(ours, schemas, npos, keywords) else None


def explicit(schema: Any, args: tuple, kwargs: tuple[tuple[str, Any], ...]
             ) -> tuple[tuple, tuple[tuple[str, Any], ...]] | None:
    """A call's argument templates with every argument the call leaves out filled in with the
    schema's default; None when a left-out argument has none."""
    pos = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(pos):
        return None
    full = list(args)
    for a in pos[len(args):]:
        if not a.has_default_value():
            return None
        full.append(a.default_value)
    given = dict(kwargs)
    named = []
    for a in schema.arguments:
        if not a.kwarg_only:
            continue
        if a.name in given:
            named.append((a.name, given.pop(a.name)))
        elif a.has_default_value():
            named.append((a.name, a.default_value))
        else:
            return None
    if given:  # a keyword the schema does not have
        return None
    return tuple(full), tuple(named)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN where the other has NaN."""
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all()) \
        if a.is_floating_point() or a.is_complex() else torch.equal(a, b)


def _checked(binding: Callable, overload: Any) -> Callable:
    """``binding`` that also runs ``overload`` and raises where they differ: in their results,
    or in what they write into their arguments (batch norm's running statistics). The overload
    runs first, on copies, so that nothing is written twice; an ``empty*`` operator's values
    are whatever the memory held: only their layout is compared."""
    values = not overload.overloadpacket.__name__.lstrip("_").startswith(("empty", "new_empty"))

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):  # its storage copied, so the layout is the same
            fresh = torch.empty(0, dtype=x.dtype, device=x.device)
            with torch.no_grad():
                return fresh.set_(x.untyped_storage().clone(), x.storage_offset(), x.size(),
                                  x.stride())
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    def flat(x: Any) -> list:
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in flat(v)]
        return [x]

    def check(g: Any, w: Any, what: str) -> None:
        if isinstance(w, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape
                    and g.stride() == w.stride() and (not values or _same(g.detach(), w))):
                raise AssertionError(f"{binding} differs from {overload} in {what}")
        elif g != w:
            raise AssertionError(f"{binding} differs from {overload} in {what}: {g!r} != {w!r}")

    def call(*args: Any, **kwargs: Any) -> Any:
        theirs = copy(args), {k: copy(v) for k, v in kwargs.items()}
        with torch.random.fork_rng(), torch.no_grad():  # the same random numbers (dropout)
            want = overload(*theirs[0], **theirs[1])
        got = binding(*args, **kwargs)
        for i, (g, w) in enumerate(zip(flat(got), flat(want))):
            check(g, w, f"output {i}")
        for i, (g, w) in enumerate(zip(flat((args, tuple(kwargs.values()))),
                                       flat((theirs[0], tuple(theirs[1].values()))))):
            if isinstance(g, torch.Tensor) and values and not _same(g.detach(), w):
                raise AssertionError(f"{binding} differs from {overload} in what it leaves "
                                     f"in argument {i}")
        return got
    return call


def _has_slot(value: Any) -> bool:
    if isinstance(value, Slot):
        return True
    return isinstance(value, (list, tuple)) and any(_has_slot(v) for v in value)


def _binder(template: tuple, names: tuple[str | None, ...]
            ) -> Callable[[dict], list]:
    """``env -> args``: the call's arguments with each slot replaced by its value in ``env``."""
    consts = list(template)
    direct = [(pos, names[v.index]) for pos, v in enumerate(template) if isinstance(v, Slot)]
    nested = [(pos, v) for pos, v in enumerate(template)
              if not isinstance(v, Slot) and _has_slot(v)]

    def bind(env: dict) -> list:
        args = consts.copy()
        for pos, name in direct:
            args[pos] = env[name]
        if nested:
            local = [None if n is None else env.get(n) for n in names]
            for pos, v in nested:
                args[pos] = _map_slots(v, local)
        return args
    return bind


def call_parts(runner: Any, ins: Any) -> tuple[Callable, tuple, tuple] | None:
    """What a prebuilt call instruction calls: ``(fn, args, kwargs)``, the argument templates
    holding ``Slot``s where the instruction's inputs go (``kwargs`` as ``(name, value)``
    pairs); None where the ordinary handler runs it (a retyped run: verification)."""
    if runner.retype is not None:
        return None
    watched = getattr(runner, "_watched", None)
    if watched and ins.ins and ins.ins[0] in watched and writes_in_place(ins.call.target):
        return None  # the handler takes the written place's gradient edge first
    lc = ins.call
    overload = fn = resolve_target(lc.target)
    args, kwargs = lc.args, lc.kwargs
    binding = fast_binding(overload) if BINDINGS else None
    full = explicit(overload._schema, args, kwargs) if binding is not None else None
    if full is not None:
        fn = _checked(binding, overload) if CHECK_BINDINGS else binding
        args, kwargs = full
    elif DIRECT:
        # what ``OpOverload.__call__`` calls: the same operator, one Python frame less per call
        fn = getattr(fn, "_op", fn)
    return fn, tuple(args), tuple(kwargs)


def _call(runner: Any, ins: Any) -> Handler:
    parts = call_parts(runner, ins)
    if parts is None:
        return runner.on_call
    fn, args, kwargs = parts
    lc = ins.call
    bind = _binder(args, ins.ins)
    kw_names = tuple(k for k, _ in kwargs)
    kw_bind = _binder(tuple(v for _, v in kwargs), ins.ins) if kwargs else None
    outs, listy, scale, loss = ins.outs, ins.listy, lc.scale, ins.loss
    env_of = lambda: runner.env  # noqa: E731 - a recomputed region swaps the table

    def run(_ins: Any) -> None:
        env = env_of()
        try:
            if kw_bind is None:
                out = fn(*bind(env))
            else:
                out = fn(*bind(env), **dict(zip(kw_names, kw_bind(env))))
        except (RuntimeError, TypeError):  # the handler retries as it does (view as reshape)
            return runner.on_call(ins)      # or names the op; a binding's refusal of the
                                            # arguments (TypeError) is raised before it runs
        got = tuple(out) if listy else (out,)
        if scale != 1.0:
            got = tuple(o * scale for o in got)
        if len(got) != len(outs):
            raise ValueError(f"operator '{ins.op}' gave {len(got)} outputs, not {len(outs)}")
        env.update(zip(outs, got))
        if loss:
            runner.record_loss(got[0], ins.count)
        return None
    return run


def _narrows(region: Region) -> list[tuple[int, int, int]] | None:
    """``(dim, start, length)`` that cut ``region`` out of its whole tensor, or None when it is
    not one box (strided parts take the general path)."""
    whole = Region.full(region.shape)
    if not whole._contiguous_in(region):
        return None
    return [(d, a, n) for d, (a, n) in enumerate(whole._narrow_args(region))
            if (a, n) != (0, region.shape[d])]


def _input(runner: Any, ins: Any) -> Handler:
    steps = [(ins.box, _narrows(ins.box)) if ins.box is not None else None,
             (ins.region, _narrows(ins.region))]
    steps = [s for s in steps if s is not None]
    if any(cuts is None for _, cuts in steps):
        return runner.on_input
    index, out = ins.index, ins.out

    def run(_ins: Any) -> None:
        x = runner.batch[index]
        for region, cuts in steps:
            if tuple(x.shape) != tuple(region.shape):
                return runner.on_input(ins)
            for d, a, n in cuts:
                x = x.narrow(d, a, n)
        runner.env[out] = x
        return None
    return run


def _param(runner: Any, ins: Any) -> Handler:
    if ins.scale != 1.0:
        return runner.on_param
    state = runner.state
    leaf = state.leaves[(ins.tensor, ins.region)]  # a leaf is never replaced (the optimizer
    out = ins.out                                  # holds it too)

    def run(_ins: Any) -> None:
        if runner.state is not state:
            return runner.on_param(ins)
        runner.env[out] = leaf
        return None
    return run


_BUILDERS: dict[str, Callable[[Any, Any], Handler]] = {"call": _call, "input": _input,
                                                        "param": _param}


def prebuild(runner: Any, ins: Any) -> Handler:
    """The handler of ``ins`` on ``runner``: a prebuilt closure, or the ordinary bound method."""
    build = _BUILDERS.get(ins.kind)
    return build(runner, ins) if build is not None else getattr(runner, "on_" + ins.kind)
