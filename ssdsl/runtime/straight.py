"""A rank's program run as straight-line Python, generated once per program (the distributed
executor only).

``Runner.run`` with prebuilt handlers still pays, per instruction and step, a loop iteration, a
closure call, an argument binder's list and a dict update. ``straight(runner, program)`` writes
the program out instead as Python functions of a few hundred instructions each, compiled once:
a call becomes ``e['y'] = f7(e['x'], K[3])`` (the callable and the argument templates that
``ssdsl.runtime.prebuilt`` works out), a weight's shard ``e['w'] = L[2]``, a batch input's
rows ``e['x'] = R.batch[0][K[4]]`` (a view, as ``Region.slice_of`` gives), a free a few
``pop``s; every other instruction is handed, as it is, to the handler ``Runner.run`` would call.

What runs is what ``Runner.run`` runs, instruction by instruction and in the program's order:
- each generated call falls back to ``runner.on_call`` where the prebuilt closure does (the
  call raised ``RuntimeError`` or ``TypeError``), and a shard to ``on_param`` where the rank's
  state was replaced;
- inside a forward-only unit or a recomputed region every instruction goes through
  ``runner.visit``, as in ``Runner.run``; whether the runner is in one is read again after each
  instruction that may change it (every one not generated inline);
- the table of values is read again after each such instruction too (a recomputed region
  swaps it).
A runner whose class overrides a handler gets that handler for that kind: only the kinds whose
handler is ``Runner``'s own are written inline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ssdsl.ops.core import Slot
from ssdsl.runtime.prebuilt import _has_slot, call_parts

# False leaves ``Runner.run`` to its loop of handlers (benchmarks compare)
ENABLED = True
# instructions per generated function (a very long function compiles slowly)
CHUNK = 400

_FILENAME = "<ssdsl rank program>"


def _drain(waits: Any) -> None:
    if waits is not None:
        for _ in waits:
            raise RuntimeError("a distributed runner never waits")


class _Source:
    """The lines and the constants of the generated functions."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.consts: list[Any] = []

    def const(self, value: Any) -> str:
        if value is None or isinstance(value, bool):
            return repr(value)
        if type(value) is int or type(value) is str:
            return repr(value)
        self.consts.append(value)
        return f"K[{len(self.consts) - 1}]"

    def value(self, v: Any, names: tuple) -> str | None:
        """The expression of an argument template ``v``: a slot's value, a list or tuple of
        them, or a constant."""
        if isinstance(v, Slot):
            name = names[v.index]
            return "None" if name is None else f"e[{name!r}]"
        if isinstance(v, (list, tuple)) and _has_slot(v):
            parts = [self.value(x, names) for x in v]
            if any(p is None for p in parts) or type(v) not in (list, tuple):
                return None  # a named tuple or another sequence type: not written inline
            inner = ", ".join(parts)
            if type(v) is list:
                return f"[{inner}]"
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        return self.const(v)


def _own(runner: Any, kind: str) -> bool:
    from ssdsl.runtime.executor import Runner
    name = "on_" + kind
    return getattr(type(runner), name, None) is getattr(Runner, name, None)


def _call_lines(src: _Source, runner: Any, ins: Any, k: int) -> list[str] | None:
    """The statements of call ``ins`` (the ``k``-th instruction), or None where it is not
    written inline."""
    parts = call_parts(runner, ins)
    if parts is None:
        return None
    fn, args, kwargs = parts
    outs, listy, scale = tuple(ins.outs), ins.listy, ins.call.scale
    if not listy and len(outs) != 1:
        return None
    if listy and not outs:
        return None
    values = [src.value(a, ins.ins) for a in args]
    named = [(name, src.value(v, ins.ins)) for name, v in kwargs]
    if any(x is None for x in values) or any(x is None or not name.isidentifier()
                                             for name, x in named):
        return None
    exprs = values + [f"{name}={x}" for name, x in named]
    f = src.const(fn)
    body = [f"o = {f}({', '.join(exprs)})"]
    tail: list[str] = []
    if listy:
        tail.append("o = tuple(o)")
        if scale != 1.0:
            tail.append(f"o = tuple(x * {src.const(scale)} for x in o)")
        said = src.const(f"operator '{ins.op}' gave ")
        tail.append(f"if len(o) != {len(outs)}:")
        tail.append(f"    raise ValueError({said} + str(len(o)) + ' outputs, not {len(outs)}')")
        targets = ", ".join(f"e[{o!r}]" for o in outs)
        tail.append(f"{targets}{',' if len(outs) == 1 else ''} = o")
        first = "o[0]"
    else:
        if scale != 1.0:
            tail.append(f"o = o * {src.const(scale)}")
        tail.append(f"e[{outs[0]!r}] = o")
        first = "o"
    if ins.loss:
        tail.append(f"R.record_loss({first}, {ins.count!r})")
    lines = ["try:", *("    " + b for b in body), "except (RuntimeError, TypeError):",
             f"    R.on_call(I[{k}])", "else:", *("    " + t for t in tail)]
    return lines


def _param_lines(src: _Source, runner: Any, ins: Any, k: int) -> list[str] | None:
    if ins.scale != 1.0:
        return None
    leaf = runner.state.leaves[(ins.tensor, ins.region)]
    return ["if R.state is S:", f"    e[{ins.out!r}] = {src.const(leaf)}", "else:",
            f"    R.on_param(I[{k}])"]


def _free_lines(src: _Source, runner: Any, ins: Any, k: int) -> list[str] | None:
    pops = "; ".join(f"t.pop({v!r}, None)" for v in ins.values)
    if not pops:
        return ["pass"]
    return ["for t in (e, R.grads, R.kept, R.edges):", "    if t:", f"        {pops}"]


def _input_lines(src: _Source, runner: Any, ins: Any, k: int) -> list[str] | None:
    """A batch input's rows: an index of slices into the whole batch (a view), where the batch
    has the shape the plan was made for; ``on_input`` otherwise (which says what is wrong)."""
    from ssdsl.runtime.executor import take_index
    shape, index = take_index(ins)
    if index is None:
        return None
    take = f"x[{src.const(index)}]" if index else "x"
    return [f"x = R.batch[{ins.index}]", f"if x.shape == {src.const(shape)}:",
            f"    e[{ins.out!r}] = {take}", "else:", f"    R.on_input(I[{k}])"]


_INLINE = {"call": _call_lines, "param": _param_lines, "free": _free_lines,
           "input": _input_lines}

_STATE = "fast = R._region is None and not R._frozen"


def straight(runner: Any, program: Any) -> Callable[[], None]:
    """``program`` on ``runner`` as generated functions: calling the result runs the whole
    program once, as ``Runner.run`` would (see the module docstring)."""
    src = _Source()
    instructions = list(program.instructions)
    handlers = [runner._handler(ins) for ins in instructions]
    chunks = []
    for lo in range(0, len(instructions), CHUNK):
        name = f"chunk{lo // CHUNK}"
        chunks.append(name)
        src.lines += [f"def {name}(R, I, H, K, S, drain, visit):", "    e = R.env",
                      f"    {_STATE}"]
        for k in range(lo, min(lo + CHUNK, len(instructions))):
            ins = instructions[k]
            make = _INLINE.get(ins.kind)
            inline = make(src, runner, ins, k) if make is not None and _own(runner, ins.kind) \
                else None
            if inline is not None:
                src.lines.append("    if fast:")
                src.lines += ["        " + x for x in inline]
                src.lines += ["    else:", f"        drain(visit(I[{k}]))",
                              f"        e = R.env; {_STATE}"]
            else:
                src.lines += ["    if fast:", f"        drain(H[{k}](I[{k}]))", "    else:",
                              f"        drain(visit(I[{k}]))",
                              f"    e = R.env; {_STATE}"]
        src.lines.append("")
    namespace: dict[str, Any] = {"K": src.consts}
    exec(compile("\n".join(src.lines), _FILENAME, "exec"), namespace)  # noqa: S102 - our own
    functions = [namespace[c] for c in chunks]
    state = runner.state
    visit = runner.visit

    def run() -> None:
        for fn in functions:
            fn(runner, instructions, handlers, src.consts, state, _drain, visit)
    run.source = "\n".join(src.lines)  # type: ignore[attr-defined] - for tests and debugging
    return run
