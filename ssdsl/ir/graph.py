"""The traced graph: logical tensors, ATen operators, parameters, and the loss.

Values here are frozen; the tracer (``ssdsl.trace``) is the only phase that builds a ``Graph``.
Vocabulary: a *dim* is a tensor dimension; a *flowing name* (``batch``, ``seq``, ``heads``) is the
name of a dim that the tracer followed from the model inputs (or from an operator that introduces
it) through every annotated operator. A dim that merges several flowing dims (the ``(B*T)`` of a
flattened activation, the ``3C`` of a fused QKV projection) has several *factors*, outermost first.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from ssdsl.source import Span, file_line, shown_path


@attrs.frozen
class TensorRef:
    """A tensor argument of an operator, by the name of the logical tensor."""

    name: str

    def __repr__(self) -> str:
        return f"%{self.name}"


@attrs.frozen
class DimFactor:
    """One factor of a tensor dim: its flowing name (or ``None``) and its size."""

    name: str | None
    size: int

    def __str__(self) -> str:
        return self.name or str(self.size)


def _default_factors(info: TensorInfo) -> tuple[tuple[DimFactor, ...], ...]:
    return tuple((DimFactor(n, s),) for n, s in zip(info.dim_names, info.shape))


@attrs.frozen
class TensorInfo:
    """A logical tensor: shape, dtype (as ``str(torch.dtype)``) and per-dim flowing names.

    ``dim_names[i]`` is the flowing name of dim ``i`` when the dim is one factor, a form like
    ``"(batch seq)"`` when it merges named factors, else ``None``. ``factors[i]`` is the finest
    factorization of dim ``i`` that the operators using this tensor agree on.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    dim_names: tuple[str | None, ...] = attrs.field()
    factors: tuple[tuple[DimFactor, ...], ...] = attrs.field(
        default=attrs.Factory(_default_factors, takes_self=True))

    @dim_names.default
    def _no_names(self) -> tuple[None, ...]:
        return (None,) * len(self.shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dim_of(self, name: str) -> int | None:
        """The dim whose factors include flowing name ``name``, or ``None``."""
        for i, fs in enumerate(self.factors):
            if any(f.name == name for f in fs):
                return i
        return None


def _freeze_kwargs(value: Mapping[str, Any] | tuple) -> tuple[tuple[str, Any], ...]:
    return tuple(value.items()) if isinstance(value, Mapping) else tuple(value)


# Short kind names for selectors (`kind(...)`), where the ATen name is long; every op the trace
# or a later rewrite makes takes its kind from ``kind_of``, so `ssdsl trace` and selectors agree.
KIND_NAMES = {"scaled_dot_product_attention": "sdpa", "cross_entropy_loss": "cross_entropy",
              "_unsafe_view": "view", "_to_copy": "to_copy"}


def kind_of(target: str) -> str:
    """The kind of an op of ATen ``target`` (``aten.cross_entropy_loss.default``: cross_entropy)."""
    name = target.split(".")[1]
    return KIND_NAMES.get(name, name)


@functools.lru_cache(maxsize=None)
def writes_in_place(target: str) -> bool:
    """``aten.relu_.default``, ``aten.add_.Tensor``: an ATen op that writes its first argument
    (its name ends in ``_``)."""
    name = target.split(".")[1] if target.count(".") >= 2 else target
    return name.endswith("_") and not name.endswith("__")


@attrs.frozen
class Op:
    """One ATen operator call of the traced forward.

    ``target`` is the overload as a string (``"aten.linear.default"``), ``kind`` a short name for
    selectors and tables (``"linear"``), ``module`` the module path that called it
    (``"h.0.attn.c_attn"``; ``""`` for the top level). ``args``/``kwargs`` are the call's arguments as
    they appear, with ``TensorRef`` in place of tensors (also inside lists); ``inputs`` lists the
    referenced tensor names in order of appearance (repeats kept), ``outputs`` the produced ones.
    ``calls`` is the module stack with each module's call number (from 0): a module called
    several times in one forward (a recycled trunk) gives ``(("blocks.0", 2), ...)`` to the
    operators of its third call; selectors read it (``stages into n over calls of X``).
    """

    name: str
    target: str
    kind: str
    module: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = attrs.field(converter=_freeze_kwargs, default=())
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    # How the outputs come back from the ATen call: "one" tensor, or a "list" of them.
    returns: str = "one"
    calls: tuple[tuple[str, int], ...] = ()

    @property
    def kwargs_dict(self) -> dict[str, Any]:
        return dict(self.kwargs)


@attrs.frozen
class Graph:
    """A traced training forward: its operators in topological order and its logical tensors.

    ``params`` and ``buffers`` map the graph's tensor name to the qualified name in the model's
    ``state_dict`` (``"h.0.attn.c_attn.weight"``); ``aliases`` gives, for each exported qualified
    name of a tied parameter, its other names (``{"lm_head.weight": ("wte.weight",), "wte.weight":
    ("lm_head.weight",)}``). torch.export may list a tied parameter once or once per name: two
    graph tensors whose qualified names are aliases are ONE parameter (sum their gradients). ``inputs`` are the batch tensors
    (then the target) in call order; ``output`` is the scalar loss.

    ``prologue`` holds operators computed once per step from the whole batch, on every rank,
    before any part runs (``ssdsl.transform.normalize``: a loss's divisor that counts over the
    whole batch). The outputs of the prologue that ``ops`` read are *step values*: they follow the
    batch at the end of ``inputs`` and are sources like it; ``ssdsl.ir.interpret.with_step_values``
    appends them to a batch. A traced graph has no prologue.
    """

    ops: tuple[Op, ...]
    tensors: Mapping[str, TensorInfo] = attrs.field(converter=MappingProxyType)
    params: Mapping[str, str] = attrs.field(converter=MappingProxyType)
    buffers: Mapping[str, str] = attrs.field(converter=MappingProxyType)
    inputs: tuple[str, ...]
    output: str
    aliases: Mapping[str, tuple[str, ...]] = attrs.field(converter=MappingProxyType,
                                                          factory=dict)
    # Constant tensors the export lifted (tensor attributes that are neither parameters nor
    # buffers), by graph name; values, not compared.
    constants: Mapping[str, Any] = attrs.field(converter=MappingProxyType, factory=dict,
                                               eq=False, hash=False)
    prologue: tuple[Op, ...] = ()
    # Where the model's code calls each operator: operator name -> (file, line), the innermost
    # frame outside torch (the model file's line, or HF's modeling file); for messages only.
    sources: Mapping[str, tuple[str, int]] = attrs.field(converter=MappingProxyType,
                                                         factory=dict, eq=False, hash=False)

    @property
    def step_values(self) -> tuple[str, ...]:
        """The inputs the prologue computes (they follow the batch in ``inputs``)."""
        if not self.prologue:
            return ()
        made = {t for op in self.prologue for t in op.outputs}
        return tuple(t for t in self.inputs if t in made)

    @property
    def batch_inputs(self) -> tuple[str, ...]:
        """The inputs a batch gives (``inputs`` without the step values)."""
        n = len(self.step_values)
        return self.inputs[:len(self.inputs) - n] if n else self.inputs

    def op(self, name: str) -> Op:
        return self._op_index[name]  # KeyError for an unknown name

    @functools.cached_property
    def _op_index(self) -> dict[str, Op]:  # planning at scale looks operators up by the million
        return {o.name: o for o in self.ops}

    def origin(self, name: str) -> Span | None:
        """The line of the model's code that calls operator ``name`` (None when unknown), for
        an error's note."""
        found = self.sources.get(name)
        if found is None:
            return None
        path, line = found
        return file_line(path, line, shown_path(path))

    def producer(self) -> dict[str, Op]:
        """Map from tensor name to the op that produces it."""
        return {t: o for o in self.ops for t in o.outputs}

    def consumers(self) -> dict[str, list[Op]]:
        """Map from tensor name to the ops that read it, in graph order."""
        out: dict[str, list[Op]] = {}
        for o in self.ops:
            for t in dict.fromkeys(o.inputs):
                out.setdefault(t, []).append(o)
        return out

    def param_by_qualname(self) -> dict[str, str]:
        """Qualified name (aliases included) to graph tensor name, for params and buffers."""
        out = {q: t for t, q in {**self.params, **self.buffers}.items()}
        for q, extra in self.aliases.items():
            for a in extra:
                out.setdefault(a, out[q])
        return out

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __reduce__(self):
        # Pickled (a launcher hands its traced graph to the ranks): the mapping proxies as dicts.
        fields = {a.name: getattr(self, a.name) for a in attrs.fields(Graph)}
        return (_graph_from_fields, (
            {k: dict(v) if isinstance(v, MappingProxyType) else v for k, v in fields.items()},))


def _graph_from_fields(fields: dict) -> Graph:
    return Graph(**fields)


def map_tensor_refs(value: Any, fn) -> Any:
    """``value`` with every ``TensorRef`` replaced by ``fn(ref)`` (inside lists and tuples too)."""
    if isinstance(value, TensorRef):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensor_refs(v, fn) for v in value)
    return value
