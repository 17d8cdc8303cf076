"""The IR interpreter: run a traced ``Graph`` one ATen operator at a time on real tensors.

Autograd flows through it (each ATen call is differentiable where PyTorch's is), so it is the
reference for the per-rank executor, which runs sub-operators the same way (``call_target``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from ssdsl.ir.graph import Graph, Op, TensorRef, map_tensor_refs


@lru_cache(maxsize=None)
def resolve_target(target: str) -> Callable[..., Any]:
    """The callable of an ATen overload string: ``"aten.linear.default"`` -> the OpOverload."""
    namespace, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def call_target(target: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Call ``target`` with concrete arguments (tensors already substituted)."""
    return resolve_target(target)(*args, **kwargs)


def run_op(op: Op, env: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run ``op`` with its tensor arguments read from ``env``; returns its outputs in order."""
    lookup = lambda ref: env[ref.name]  # noqa: E731
    args = map_tensor_refs(op.args, lookup)
    kwargs = {k: map_tensor_refs(v, lookup) for k, v in op.kwargs}
    result = call_target(op.target, args, kwargs)
    return tuple(result) if op.returns == "list" else (result,)


def with_step_values(graph: Graph, batch: Sequence[Any]) -> tuple[Any, ...]:
    """``batch`` (one tensor per ``graph.batch_inputs``) followed by the step values its
    prologue computes from it (``Graph.prologue``); ``batch`` itself when there is none, or when
    it already holds one tensor per ``graph.inputs``."""
    batch = tuple(batch)
    if not graph.prologue or len(batch) == len(graph.inputs):
        return batch
    env: dict[str, Any] = dict(zip(graph.batch_inputs, batch, strict=True))
    env.update(graph.constants)
    with torch.no_grad():  # data only: no parameter reaches the prologue
        for op in graph.prologue:
            env.update(zip(op.outputs, run_op(op, env), strict=True))
    return batch + tuple(env[t] for t in graph.step_values)


def step_values_fn(graph: Graph) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``with_step_values(graph, ·)`` with the prologue's operators resolved and its names
    read once (an executor computes the step values every step)."""
    if not graph.prologue:
        return tuple
    names, n_inputs, wanted = graph.batch_inputs, len(graph.inputs), graph.step_values
    constants = dict(graph.constants)
    ops = [(resolve_target(op.target), op.args, op.kwargs, op.outputs, op.returns == "list")
           for op in graph.prologue]

    def values(batch: Sequence[Any]) -> tuple[Any, ...]:
        batch = tuple(batch)
        if len(batch) == n_inputs:
            return batch
        env: dict[str, Any] = dict(zip(names, batch, strict=True))
        env.update(constants)
        lookup = lambda ref: env[ref.name]  # noqa: E731
        with torch.no_grad():  # data only: no parameter reaches the prologue
            for fn, args, kwargs, outs, listy in ops:
                out = fn(*map_tensor_refs(args, lookup),
                         **{k: map_tensor_refs(v, lookup) for k, v in kwargs})
                env.update(zip(outs, tuple(out) if listy else (out,), strict=True))
        return batch + tuple(env[t] for t in wanted)
    return values


def run_graph(graph: Graph, params: Mapping[str, torch.Tensor],
              inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The loss of ``graph`` on ``inputs`` (batch tensors then target) with ``params``.

    ``params`` maps qualified names (``"h.0.attn.c_attn.weight"``, as in ``model.state_dict()`` or
    ``named_parameters()``) to tensors, buffers included; tied names may be given once.
    """
    env: dict[str, torch.Tensor] = dict(zip(graph.inputs, with_step_values(graph, inputs),
                                            strict=True))
    for tname, qual in {**graph.params, **graph.buffers}.items():
        env[tname] = _lookup_param(graph, params, qual)
    env.update(graph.constants)
    for op in graph.ops:
        env.update(zip(op.outputs, run_op(op, env), strict=True))
    return env[graph.output]


def _lookup_param(graph: Graph, params: Mapping[str, torch.Tensor], qual: str) -> torch.Tensor:
    for name in (qual, *graph.aliases.get(qual, ())):
        if name in params:
            return params[name]
    raise KeyError(f"no value for parameter or buffer '{qual}'")


__all__ = ["run_graph", "run_op", "step_values_fn", "with_step_values", "call_target", "resolve_target", "TensorRef"]
