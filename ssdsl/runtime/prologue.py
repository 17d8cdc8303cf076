"""The step values of a graph's prologue, computed by straight-line Python generated once per
graph (the distributed executor's ``begin``).

A loss that divides by a count the data decides (``ssdsl.transform.normalize``) has a prologue:
a few operators on the whole batch (``reshape``, ``ne``, ``sum`` for a cross-entropy's count of
labelled tokens) that every rank runs once per step before its program. Interpreted op by op
(``ssdsl.ir.interpret.step_values_fn``: a lookup table, an argument mapper and the overload's
``__call__`` per operator) it cost about three times its own ATen calls, on a step of a few
milliseconds where every microsecond outside the model counts against ``DistributedDataParallel``.

``step_values_code(graph)`` writes the prologue out as one function instead: each operator a
call of torch's generated binding (``ssdsl.runtime.prebuilt.fast_binding``, every argument
explicit) or of the overload's own callable, its arguments written inline. It computes what
``with_step_values`` computes, from the same operators in the same order; where a binding
refuses its arguments (``TypeError``, raised before anything runs) or an operator raises, the
whole prologue runs again through the interpreter, which raises what the user should see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ssdsl.ir.graph import Graph, TensorRef
from ssdsl.ir.interpret import resolve_target, step_values_fn
from ssdsl.runtime import prebuilt

# False: the interpreter's ``step_values_fn``, read at every call (benchmarks compare)
ENABLED = True

_FILENAME = "<ssdsl step values>"


class _Writer:
    """The lines and constants of the generated function, and the names of its values."""

    def __init__(self, graph: Graph) -> None:
        self.consts: list[Any] = []
        self.names: dict[str, str] = {n: f"b[{i}]" for i, n in enumerate(graph.batch_inputs)}
        for name, value in dict(graph.constants).items():
            self.names[name] = self.const(value)

    def const(self, value: Any) -> str:
        if value is None or isinstance(value, bool) or type(value) in (int, str):
            return repr(value)
        self.consts.append(value)
        return f"K[{len(self.consts) - 1}]"

    def expr(self, v: Any) -> str:
        """The expression of an argument: a value by name, a list or tuple of them, a constant."""
        if isinstance(v, TensorRef):
            return self.names[v.name]
        if type(v) in (list, tuple) and any(_has_ref(x) for x in v):
            inner = ", ".join(self.expr(x) for x in v)
            if type(v) is list:
                return f"[{inner}]"
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if _has_ref(v):
            raise _NotInline(v)
        return self.const(v)


class _NotInline(Exception):
    """An argument the writer cannot express (a tensor inside another container type)."""


def _has_ref(v: Any) -> bool:
    if isinstance(v, TensorRef):
        return True
    return isinstance(v, (list, tuple)) and any(_has_ref(x) for x in v)


def _callable(target: str) -> tuple[Callable, bool]:
    """What the generated code calls for ``target``, and whether every argument must be
    passed (a binding's defaults may differ from the schema's)."""
    overload = resolve_target(target)
    binding = prebuilt.fast_binding(overload) if prebuilt.BINDINGS else None
    if binding is not None:
        fn = prebuilt._checked(binding, overload) if prebuilt.CHECK_BINDINGS else binding
        return fn, True
    return getattr(overload, "_op", overload), False


def _source(graph: Graph, w: _Writer) -> list[str]:
    lines = ["def values(b):", f"    if len(b) == {len(graph.inputs)}:", "        return b",
             "    with no_grad():"]
    for k, op in enumerate(graph.prologue):
        fn, whole = _callable(op.target)
        args, kwargs = op.args, tuple(op.kwargs)
        if whole:
            full = prebuilt.explicit(resolve_target(op.target)._schema, tuple(args), kwargs)
            if full is None:
                fn, whole = getattr(resolve_target(op.target), "_op", fn), False
            else:
                args, kwargs = full
        exprs = [w.expr(a) for a in args] + [f"{name}={w.expr(v)}" for name, v in kwargs]
        if any(not name.isidentifier() for name, _ in kwargs):
            raise _NotInline(kwargs)
        call = f"{w.const(fn)}({', '.join(exprs)})"
        if op.returns == "list":
            lines.append(f"        o = tuple({call})")
            lines.append(f"        if len(o) != {len(op.outputs)}:")
            lines.append("            raise RuntimeError('a prologue operator gave another "
                         "number of outputs')")
            for i, out in enumerate(op.outputs):
                w.names[out] = f"v{k}_{i}"
            lines.append(f"        {', '.join(w.names[o] for o in op.outputs)}, = o")
        else:
            if len(op.outputs) != 1:
                raise _NotInline(op.outputs)
            w.names[op.outputs[0]] = f"v{k}"
            lines.append(f"        v{k} = {call}")
    wanted = ", ".join(w.names[t] for t in graph.step_values)
    lines.append(f"    return b + ({wanted}{',' if len(graph.step_values) == 1 else ''})")
    return lines


def step_values_code(graph: Graph) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``with_step_values(graph, ·)`` as one generated function (see the module docstring);
    the interpreter's ``step_values_fn`` where the prologue cannot be written out."""
    generic = step_values_fn(graph)
    if not graph.prologue or not ENABLED:
        return generic
    w = _Writer(graph)
    try:
        lines = _source(graph, w)
    except (_NotInline, KeyError):  # an argument or a value it cannot name: the interpreter's
        return generic
    namespace: dict[str, Any] = {"K": w.consts, "no_grad": torch.no_grad}
    exec(compile("\n".join(lines), _FILENAME, "exec"), namespace)  # noqa: S102 - our own
    fast = namespace["values"]

    def values(batch: Sequence[Any]) -> tuple[Any, ...]:
        batch = tuple(batch)
        if not ENABLED:
            return generic(batch)
        try:
            return fast(batch)
        except (RuntimeError, TypeError):  # the interpreter says what is wrong, or does it
            return generic(batch)
    values.source = "\n".join(lines)  # type: ignore[attr-defined] - for tests and debugging
    return values


__all__ = ["ENABLED", "step_values_code"]
