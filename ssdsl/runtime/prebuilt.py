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

from collections.abc import Callable
from typing import Any

from ssdsl.ir.interpret import resolve_target
from ssdsl.ir.region import Region
from ssdsl.ops.core import Slot, _map_slots

Handler = Callable[[Any], Any]

# True calls an ATen overload's own callable (``OpOverload._op``) rather than the overload object
# (benchmarks compare)
DIRECT = True


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


def _call(runner: Any, ins: Any) -> Handler:
    lc = ins.call
    if runner.retype is not None:
        return runner.on_call
    fn = resolve_target(lc.target)
    if DIRECT:
        # what ``OpOverload.__call__`` calls: the same operator, one Python frame less per call
        fn = getattr(fn, "_op", fn)
    bind = _binder(lc.args, ins.ins)
    kw_names = tuple(k for k, _ in lc.kwargs)
    kw_bind = _binder(tuple(v for _, v in lc.kwargs), ins.ins) if lc.kwargs else None
    outs, listy, scale, loss = ins.outs, ins.listy, lc.scale, ins.loss
    env_of = lambda: runner.env  # noqa: E731 - a recomputed region swaps the table

    def run(_ins: Any) -> None:
        env = env_of()
        try:
            if kw_bind is None:
                out = fn(*bind(env))
            else:
                out = fn(*bind(env), **dict(zip(kw_names, kw_bind(env))))
        except RuntimeError:  # the handler retries as it does (view as reshape) or names the op
            return runner.on_call(ins)
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
