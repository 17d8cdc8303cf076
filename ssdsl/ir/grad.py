"""Which tensors of a traced graph need a gradient.

A tensor needs one when autograd would give it a ``grad_fn`` in a training step: it is a floating
parameter, or an operator computed it differentiably from one. A floating tensor built only from
buffers, constants or the batch (the rotary ``cos``/``sin`` tables of LLaMA-style models, an
attention mask, a position table) needs none, and neither does the output of a non-differentiable
operator (``zeros_like``, ``detach``, comparisons). Planning gradient communication for such a
tensor would make a rank wait for a gradient that no rank computes.

A tensor that requires a gradient but that the loss does not depend on differentiably (the
output of a recycling pass before its ``.detach()``: AlphaFold2's first trunk passes) gets
none either: backward never reaches it, so no rank would send one. ``loss_grad_tensors`` keeps,
of ``grad_tensors``, those from which the loss is reached through tensors that need a gradient.

The answer is autograd's own: every operator is run once on ``meta`` tensors (no memory, no
arithmetic) with the parameters requiring grad, and an output needs a gradient exactly when the
result ``requires_grad``. An operator that cannot run on ``meta`` (a data-dependent shape) falls
back to the usual rule: a floating output of an operator with an input that needs a gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from ssdsl.ir.graph import Graph, Op, map_tensor_refs
from ssdsl.ir.interpret import call_target

_META = torch.device("meta")


_CACHE: dict[int, tuple[Graph, frozenset[str]]] = {}


def grad_tensors(graph: Graph) -> frozenset[str]:
    """Names of the tensors of ``graph`` that need a gradient (see the module doc).

    >>> # doctest: +SKIP
    >>> "cos" in grad_tensors(trace(load_model_file("examples/hf_llama.py")))
    False
    """
    hit = _CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    found = _grad_tensors(graph)
    if len(_CACHE) > 32:  # a planning process sees few graphs; keep the newest
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[id(graph)] = (graph, found)
    return found


def _grad_tensors(graph: Graph, *, remember: bool = True) -> frozenset[str]:
    """The answer of ``grad_tensors``; ``remember=False`` runs every operator on meta."""
    env: dict[str, torch.Tensor] = {}
    for name in (*graph.inputs, *graph.params, *graph.buffers, *graph.constants):
        t = _empty(graph, name)
        if t is not None:
            env[name] = t.requires_grad_(name in graph.params and t.is_floating_point())
    needs: set[str] = {n for n, t in env.items() if t.requires_grad}
    ruled: set[str] = set()  # outputs of operators that could not run on meta
    # An operator called again with arguments alike (the layers of a deep model) gives the same
    # answer: the outputs needing a gradient are remembered by the call's signature, and only
    # a call unlike every earlier one runs on meta (with its inputs made from their shapes where
    # a remembered call left none)
    seen: dict[tuple, tuple[bool, ...] | None] = {}
    with torch.enable_grad():
        for op in graph.ops:
            key = _signature(graph, op, needs, ruled) if remember else None
            found = seen.get(key, _UNSEEN) if key is not None else _UNSEEN
            if found is _UNSEEN:
                outs = _run_meta(op, env, graph, needs, ruled)
                found = None if outs is None else tuple(
                    isinstance(v, torch.Tensor) and v.requires_grad for v in outs)
                if outs is not None:
                    env.update((n, v) for n, v in zip(op.outputs, outs)
                               if isinstance(v, torch.Tensor))
                if key is not None:
                    seen[key] = found
            if found is None:  # the rule autograd follows for almost every operator
                grad_in = any(x in needs for x in op.inputs)
                needs.update(x for x in op.outputs if grad_in and _floating(graph, x))
                ruled.update(op.outputs)
                for x in op.outputs:
                    env.pop(x, None)
                continue
            needs.update(x for x, grad in zip(op.outputs, found) if grad)
    return frozenset(needs)


_UNSEEN = object()


def _signature(graph: Graph, op: Op, needs: set[str], ruled: set[str]) -> tuple | None:
    """What decides ``op``'s answer: its overload and arguments, each tensor as its shape,
    dtype and whether it needs a gradient; None where an argument has no hashable form."""
    tensors = graph.tensors

    def sig(ref):
        info = tensors.get(ref.name)
        if info is None or ref.name in ruled:
            return ("?", ref.name)
        return ("T", tuple(info.shape), info.dtype, ref.name in needs)

    try:
        key = (op.target, op.returns, len(op.outputs),
               _hashable(map_tensor_refs(op.args, sig)),
               _hashable(tuple((k, map_tensor_refs(v, sig)) for k, v in op.kwargs)))
        hash(key)
    except TypeError:
        return None
    return key


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_hashable(v) for v in value))
    return value


def loss_grad_tensors(graph: Graph) -> frozenset[str]:
    """The tensors of ``grad_tensors(graph)`` whose gradient backward computes: the loss, and
    every input of an operator with an output in this set that needs a gradient."""
    needs = grad_tensors(graph)
    reached = {graph.output} & needs
    for op in reversed(graph.ops):
        if any(x in reached for x in op.outputs):
            reached.update(x for x in op.inputs if x in needs)
    return frozenset(reached)


def _run_meta(op: Op, env: dict[str, torch.Tensor], graph: Graph, needs: set[str],
              ruled: set[str]) -> tuple[Any, ...] | None:
    """``op``'s outputs computed on ``meta``, or None when it cannot run there. An input that a
    remembered call left without a value is made from its shape (needing a gradient as found)."""
    for x in op.inputs:
        if x not in env:
            made = None if x in ruled else _made(graph, x, x in needs)
            if made is None:
                return None
            env[x] = made
    lookup = lambda ref: env[ref.name]  # noqa: E731
    args = map_tensor_refs(op.args, lookup)
    kwargs = {k: _on_meta(k, map_tensor_refs(v, lookup)) for k, v in op.kwargs}
    try:
        out = call_target(op.target, args, kwargs)
    except Exception:  # noqa: BLE001 - any failure means: decide by the rule instead
        return None
    outs = tuple(out) if op.returns == "list" else (out,)
    return outs if len(outs) == len(op.outputs) else None


def _empty(graph: Graph, name: str) -> torch.Tensor | None:
    """A meta tensor of ``name``'s shape and dtype (None: the graph does not say them)."""
    info = graph.tensors.get(name)
    dtype = None if info is None else getattr(torch, info.dtype.removeprefix("torch."), None)
    return torch.empty(info.shape, dtype=dtype, device=_META) \
        if isinstance(dtype, torch.dtype) else None


def _made(graph: Graph, name: str, grad: bool) -> torch.Tensor | None:
    t = _empty(graph, name)
    # computed, not a leaf: as the value it stands for (in-place operators accept it)
    return t.requires_grad_().clone() if t is not None and grad and t.is_floating_point() else t


def _on_meta(key: str, value: Any) -> Any:
    # creation operators traced on the CPU would allocate for real; on meta they cost nothing
    return _META if key == "device" and value is not None else value


def _floating(graph: Graph, name: str) -> bool:
    info = graph.tensors.get(name)
    return info is not None and ("float" in info.dtype or "complex" in info.dtype)


__all__ = ["grad_tensors", "loss_grad_tensors"]
