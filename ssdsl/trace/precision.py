"""The precision a traced model really computes in.

``--dtype float64`` casts the model's parameters and floating inputs, but a model may still
compute part of its forward in a lower precision: Hugging Face models cast the logits with
``.float()`` before the loss, mixed-precision code casts to ``bfloat16``. Then the single-device
reference and the parallel run both compute that part in float32, in a different order of sums,
and differ by float32 rounding: a check that expects float64 agreement reports a false mismatch.
``computing_precision`` finds the lowest floating precision of any operator's output that carries
the values being trained (it depends on a parameter or on a floating batch input), so the check
can judge with that precision's tolerance and say why. A float32 tensor made from constants alone
(OPT's ``torch.ones`` attention mask, a rotary table computed from a buffer) is computed the same
way on one device and on every rank, so it adds no rounding difference and does not loosen the
check.
"""

from __future__ import annotations

import attrs
import torch

from ssdsl.ir.graph import Graph


@attrs.frozen
class Precision:
    """The lowest floating dtype the graph computes in, and the first operator that makes it
    (None when it is the run's own dtype)."""

    dtype: torch.dtype
    op: str | None = None
    module: str | None = None

    def note(self) -> str | None:
        """One line for the user, or None when the model computes in the run's dtype."""
        if self.op is None:
            return None
        where = f" in '{self.module}'" if self.module else ""
        return (f"part of the model computes in {_short(self.dtype)} (first at operator "
                f"'{self.op}'{where}): the check uses {_short(self.dtype)}'s tolerance")


def computing_precision(graph: Graph, dtype: torch.dtype) -> Precision:
    """The lowest-precision floating dtype among the outputs of ``graph``'s operators that depend
    on a parameter or a floating batch input, if lower than ``dtype`` (the run's dtype), with the
    first operator that produces it.

    >>> computing_precision(graph_of_a_float64_model, torch.float64)          # doctest: +SKIP
    Precision(dtype=torch.float64, op=None, module=None)
    """
    worst = Precision(dtype)
    carries = set(graph.params) | {t for t in graph.inputs if t in graph.tensors
                                   and _floating(graph.tensors[t].dtype) is not None}
    for op in graph.ops:
        if not carries.intersection(op.inputs):
            continue
        carries.update(op.outputs)
        for t in op.outputs:
            found = _floating(graph.tensors[t].dtype) if t in graph.tensors else None
            if found is not None and _eps(found) > _eps(worst.dtype):
                worst = Precision(found, op.name, op.module)
    return worst


def _floating(name: str) -> torch.dtype | None:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PrecisionWatch:
    """``computing_precision`` read off a running model instead of a traced graph: inside
    ``with PrecisionWatch(dtype, seeds):`` every operator whose inputs carry the trained values
    (a tensor of ``seeds``, the parameters and floating inputs, or made from one) passes that on
    to its outputs, and ``dtype`` becomes the lowest floating precision among them.

    Verification runs a plan traced in float32 in float64: that trace has no trace of the
    model's own ``.float()`` casts (a no-op on float32), so the plain model, run in float64,
    tells where it computes in float32.
    """

    def __init__(self, dtype: torch.dtype, seeds) -> None:
        from torch.utils.weak import WeakIdKeyDictionary
        self.dtype = dtype
        self.carry = WeakIdKeyDictionary()
        for t in seeds:
            if isinstance(t, torch.Tensor):
                self.carry[t] = True
        self._mode = None

    def __enter__(self) -> "PrecisionWatch":
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        watch = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if any(isinstance(t, torch.Tensor) and t in watch.carry
                       for t in tree_leaves((args, kwargs))):
                    for t in tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            watch.carry[t] = True
                            if t.is_floating_point() and _eps(t.dtype) > _eps(watch.dtype):
                                watch.dtype = t.dtype
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

