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


def _grad_tensors(graph: Graph) -> frozenset[str]:
    env: dict[str, torch.Tensor] = {}
    for name in (*graph.inputs, *graph.params, *graph.buffers, *graph.constants):
        info = graph.tensors.get(name)
        if info is None:
            continue
        dtype = getattr(torch, info.dtype.removeprefix("torch."))
        t = torch.empty(info.shape, dtype=dtype, device=_META)
        env[name] = t.requires_grad_(name in graph.params and t.is_floating_point())
    needs: set[str] = {n for n, t in env.items() if t.requires_grad}
    with torch.enable_grad():
        for op in graph.ops:
            outs = _run_meta(op, env)
            if outs is None:  # the rule autograd follows for almost every operator
                grad_in = any(x in needs for x in op.inputs)
                needs.update(x for x in op.outputs if grad_in and _floating(graph, x))
                for x in op.outputs:
                    env.pop(x, None)
                continue
            for name, value in zip(op.outputs, outs):
                if isinstance(value, torch.Tensor):
                    env[name] = value
                    if value.requires_grad:
                        needs.add(name)
    return frozenset(needs)


def loss_grad_tensors(graph: Graph) -> frozenset[str]:
    """The tensors of ``grad_tensors(graph)`` whose gradient backward computes: the loss, and
    every input of an operator with an output in this set that needs a gradient."""
    needs = grad_tensors(graph)
    reached = {graph.output} & needs
    for op in reversed(graph.ops):
        if any(x in reached for x in op.outputs):
            reached.update(x for x in op.inputs if x in needs)
    return frozenset(reached)


def _run_meta(op: Op, env: dict[str, torch.Tensor]) -> tuple[Any, ...] | None:
    """``op``'s outputs computed on ``meta``, or None when it cannot run there."""
    if any(x not in env for x in op.inputs):
        return None
    lookup = lambda ref: env[ref.name]  # noqa: E731
    args = map_tensor_refs(op.args, lookup)
    kwargs = {k: _on_meta(k, map_tensor_refs(v, lookup)) for k, v in op.kwargs}
    try:
        out = call_target(op.target, args, kwargs)
    except Exception:  # noqa: BLE001 - any failure means: decide by the rule instead
        return None
    outs = tuple(out) if op.returns == "list" else (out,)
    return outs if len(outs) == len(op.outputs) else None


def _on_meta(key: str, value: Any) -> Any:
    # creation operators traced on the CPU would allocate for real; on meta they cost nothing
    return _META if key == "device" and value is not None else value


def _floating(graph: Graph, name: str) -> bool:
    info = graph.tensors.get(name)
    return info is not None and ("float" in info.dtype or "complex" in info.dtype)


__all__ = ["grad_tensors", "loss_grad_tensors"]
