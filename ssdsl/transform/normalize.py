"""Loss normalization, derived from the traced graph before any operator is split.

A loss that divides by something the data decides (cross-entropy averaged over the targets that
are not ``ignore_index``, a masked mean ``(l * m).sum() / m.sum()``, a ``reduction='sum'`` loss
divided by a count computed in the forward) is not a mean over examples: scaling each part by its
share of the batch is wrong as soon as the parts hold different counts. The rule here:

1. *Mean losses with a data-dependent divisor* (``cross_entropy``, ``nll_loss`` with integer
   targets and ``reduction='mean'``) become their per-target terms divided by the divisor, summed:
   ``sum(terms / D)`` with ``D`` the count of kept targets (the sum of their class weights when the
   loss has weights). Plain means whose divisor is a size (``mse_loss``, ``x.mean()``) keep the
   share scaling of their annotation.
2. *A batch sum divided by a batch-wide value* ``sum(X) / D`` (``D`` a scalar computed from the
   batch only, or a number) becomes ``sum(X / D)``; a loss op with ``reduction='sum'`` is first
   written as its terms summed. The loss then ends in a plain sum: its parts (data-parallel
   parts, micro-batches) add up to it with no scale and no communication.
3. *The prologue*: a value computed from the batch alone (no parameter, no buffer) that reduces
   over a flowing dim and is read by the model's operators (the ``D`` above) is computed, with
   every operator it needs, once per step from the whole batch on every rank, before any part
   runs (``Graph.prologue``; an operator the model also reads, such as a view of the target,
   runs in both). Its results are *step values*: graph inputs like the batch, which every rank
   holds whole and reads locally. So the numerators are summed across parts (by the
   value parts of the sum, as any partial sum) and divided once by the whole batch's count.

A divisor that depends on parameters is left in the graph: under data parallelism the adapters
sum its value parts like any other partial sum before the division; micro-batches cannot (a
micro-batch's backward would need the later micro-batches' share), and are refused at the
``microbatch`` statement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from ssdsl.ir.graph import Graph, Op, TensorInfo, TensorRef, kind_of

# loss overload -> (position of weight or None, position of reduction, position of ignore_index)
_TERM_LOSSES = {
    "aten.cross_entropy_loss.default": (2, 3, 4),
    "aten.nll_loss.default": (2, 3, 4),
    "aten.nll_loss_nd.default": (2, 3, 4),
    "aten.mse_loss.default": (None, 2, None),
    "aten.l1_loss.default": (None, 2, None),
    "aten.smooth_l1_loss.default": (None, 2, None),
    "aten.binary_cross_entropy_with_logits.default": (None, 4, None),
}
_NAMES = {2: "weight", 3: "reduction", 4: "ignore_index"}
_REDUCTION_NAME = {"aten.binary_cross_entropy_with_logits.default": "reduction"}
_MEAN, _SUM, _NONE = 1, 2, 0
_COUNTED = ("aten.cross_entropy_loss.default", "aten.nll_loss.default",
            "aten.nll_loss_nd.default")
_FULL_SUMS = ("aten.sum.default", "aten.sum.dim_IntList")
_SCALINGS = ("aten.div.Tensor", "aten.div.Scalar", "aten.mul.Scalar")


def normalize_losses(graph: Graph) -> Graph:
    """``graph`` with its loss normalization made explicit (see the module doc); the same graph
    when nothing applies."""
    if graph.prologue:
        return graph
    b = _Rewriter(graph)
    b.counted_means()
    b.sums_over_divisors()
    return b.hoisted()


class _Rewriter:
    """The mutable op list and tensor table of one rewrite."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.ops: list[Op] = list(graph.ops)
        self.tensors: dict[str, TensorInfo] = dict(graph.tensors)
        self.taken = {op.name for op in graph.ops} | set(graph.tensors)

    # ------------------------------------------------------------------ helpers
    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def new_op(self, like: Op, base: str, target: str, args: tuple, info: TensorInfo,
               kwargs: tuple = ()) -> Op:
        """A one-output op named like ``base`` in ``like``'s module; its tensor is ``info``."""
        name = self.fresh(base)
        self.tensors[name] = attrs.evolve(info, name=name)
        inputs = tuple(_refs(args)) + tuple(_refs(tuple(v for _, v in kwargs)))
        return Op(name=name, target=target, kind=kind_of(target), module=like.module,
                  args=args, kwargs=kwargs, inputs=inputs, outputs=(name,))

    def consumers(self, tensor: str) -> list[Op]:
        return [op for op in self.ops if tensor in op.inputs]

    def replace(self, old: Op, new: list[Op]) -> None:
        i = self.ops.index(old)
        self.ops[i:i + 1] = new

    def data_only(self) -> set[str]:
        """Tensors computed from the batch and lifted constants alone (no parameter, no buffer);
        ops without tensor inputs are left out (their creation arguments may name a device)."""
        found = set(self.graph.inputs) | set(self.graph.constants)
        for op in self.ops:
            if op.inputs and all(t in found for t in op.inputs):
                found.update(op.outputs)
        return found

    # ------------------------------------------------------------------ rule 1
    def counted_means(self) -> None:
        for op in list(self.ops):
            if op.target not in _COUNTED or _arg(op, 3, "reduction", _MEAN) != _MEAN:
                continue
            target = self.tensors[op.inputs[1]] if len(op.inputs) > 1 else None
            if target is None or "int" not in target.dtype:  # class probabilities: / batch size
                continue
            terms = self._terms(op)
            count = self._count(op)
            self._sum_of_quotient(op, terms, count[-1].outputs[0], before=count)

    def _terms(self, op: Op) -> Op:
        """``op`` with ``reduction='none'``: its per-target terms."""
        t = self.tensors[op.inputs[1]]
        x = self.tensors[op.inputs[0]]
        _, red, _ = _TERM_LOSSES[op.target]
        args, kwargs = _set_arg(op, red, _REDUCTION_NAME.get(op.target, "reduction"), _NONE)
        shape_of = t if op.target in _COUNTED else x
        return self.new_op(op, f"{op.name}_terms", op.target, args,
                           attrs.evolve(shape_of, dtype=x.dtype), kwargs)

    def _count(self, op: Op) -> list[Op]:
        """Ops that compute the divisor of a counted mean: the kept targets, or their weights."""
        t_ref = op.args[1] if len(op.args) > 1 else op.kwargs_dict["target"]
        t = self.tensors[t_ref.name]
        ignore = _arg(op, 4, "ignore_index", -100)
        kept = self.new_op(op, f"{op.name}_kept", "aten.ne.Scalar", (t_ref, ignore),
                           attrs.evolve(t, dtype="torch.bool"))
        scalar = TensorInfo("", (), "torch.int64")
        weight = _arg(op, 2, "weight", None)
        if weight is None:
            return [kept, self.new_op(op, f"{op.name}_count", "aten.sum.default",
                                      (TensorRef(kept.name),), scalar)]
        w = self.tensors[weight.name]
        safe = self.new_op(op, f"{op.name}_safe", "aten.where.ScalarOther",
                           (TensorRef(kept.name), t_ref, 0), t)
        picked = self.new_op(op, f"{op.name}_w", "aten.index.Tensor",
                             (weight, (TensorRef(safe.name),)), attrs.evolve(t, dtype=w.dtype))
        masked = self.new_op(op, f"{op.name}_wkept", "aten.mul.Tensor",
                             (TensorRef(picked.name), TensorRef(kept.name)),
                             attrs.evolve(t, dtype=w.dtype))
        return [kept, safe, picked, masked,
                self.new_op(op, f"{op.name}_count", "aten.sum.default",
                            (TensorRef(masked.name),), attrs.evolve(scalar, dtype=w.dtype))]

    def _sum_of_quotient(self, op: Op, terms: Op, divisor, *, before: list[Op] = (),
                         target: str = "aten.div.Tensor") -> None:
        """Replace ``op`` (whose one output is kept) by ``before``, ``terms``,
        ``terms / divisor`` and their sum."""
        info = self.tensors[terms.outputs[0]]
        d = TensorRef(divisor) if isinstance(divisor, str) else divisor
        quot = self.new_op(op, f"{op.name}_normalized", target, (TensorRef(terms.name), d), info)
        out = op.outputs[0]
        total = Op(name=op.name, target="aten.sum.default", kind="sum", module=op.module,
                   args=(TensorRef(quot.name),), inputs=(quot.name,), outputs=(out,))
        self.replace(op, [*before, terms, quot, total])

    # ------------------------------------------------------------------ rule 2
    def sums_over_divisors(self) -> None:
        data = self.data_only()
        producer = {t: op for op in self.ops for t in op.outputs}
        for op in list(self.ops):
            if op.target not in _SCALINGS or op not in self.ops:
                continue
            num = op.inputs[0] if op.inputs else None
            src = producer.get(num)
            if src is None or src not in self.ops or len(self.consumers(num)) != 1:
                continue
            if self.tensors[num].shape != () or self.tensors[op.outputs[0]].shape != ():
                continue
            divisor = op.args[1]
            if isinstance(divisor, TensorRef) and not self._batch_wide(divisor.name, data):
                continue
            if src.target in _FULL_SUMS and _sums_everything(src, self.tensors):
                summed = self.tensors[src.inputs[0]]
                terms_ref = src.args[0]
                self.ops.remove(src)
                quot = self.new_op(op, f"{op.name}_normalized", op.target,
                                   (terms_ref, divisor), summed)
                total = Op(name=op.name, target="aten.sum.default", kind="sum",
                           module=op.module, args=(TensorRef(quot.name),),
                           inputs=(quot.name,), outputs=op.outputs)
                self.replace(op, [quot, total])
            elif src.target in _TERM_LOSSES and \
                    _arg(src, _TERM_LOSSES[src.target][1], "reduction", _MEAN) == _SUM:
                terms = self._terms(src)
                self.ops.remove(src)
                self._sum_of_quotient(op, terms, divisor, target=op.target)

    def _batch_wide(self, name: str, data: set[str]) -> bool:
        """A one-element value computed from the batch alone."""
        info = self.tensors[name]
        return name in data and all(s == 1 for s in info.shape)

    # ------------------------------------------------------------------ rule 3
    def hoisted(self) -> Graph:
        data = self.data_only()
        producer = {t: op for op in self.ops for t in op.outputs}
        named = lambda t: any(f.name for fs in self.tensors[t].factors for f in fs)  # noqa: E731
        reads_flow = _flowing_ancestry(self.ops, data, named)
        wanted = [t for op in self.ops if not set(op.outputs) <= data for t in op.inputs
                  if t in data and t in producer and not named(t) and reads_flow.get(t)]
        if not wanted:
            return self._graph(self.ops, (), ())
        hoist: set[str] = set()
        stack = list(wanted)
        while stack:
            op = producer.get(stack.pop())
            if op is None or op.name in hoist:
                continue
            hoist.add(op.name)
            stack.extend(op.inputs)
        step = tuple(dict.fromkeys(wanted))
        # what the model's operators read besides the step values stays in the graph: an op
        # both need (the target's view) runs in both, the prologue's copy on the whole batch
        keep: set[str] = set()
        stack = [t for op in self.ops if op.name not in hoist for t in op.inputs
                 if t not in step]
        while stack:
            op = producer.get(stack.pop())
            if op is None or op.name not in hoist or op.name in keep:
                continue
            keep.add(op.name)
            stack.extend(op.inputs)
        prologue = tuple(op for op in self.ops if op.name in hoist)
        main = [op for op in self.ops if op.name not in hoist or op.name in keep]
        return self._graph(main, prologue, step)

    def _graph(self, ops: list[Op], prologue: tuple[Op, ...], step: tuple[str, ...]) -> Graph:
        if ops == list(self.graph.ops):
            return self.graph
        used = {t for op in (*ops, *prologue) for t in (*op.inputs, *op.outputs)}
        keep = set(self.graph.tensors) | used
        return attrs.evolve(self.graph, ops=tuple(ops), prologue=prologue,
                            inputs=(*self.graph.inputs, *step),
                            tensors={k: v for k, v in self.tensors.items() if k in keep})


def _flowing_ancestry(ops: list[Op], data: set[str], named) -> dict[str, bool]:
    """For each data-only tensor, whether it or a data-only tensor it is computed from has a
    flowing dim (a count over the batch has; a constant has not)."""
    out = {t: named(t) for t in data}
    for op in ops:
        if set(op.outputs) <= data:
            seen = any(out.get(t, False) for t in op.inputs)
            for t in op.outputs:
                out[t] = out.get(t, False) or seen
    return out


def _sums_everything(op: Op, tensors: Mapping[str, TensorInfo]) -> bool:
    if op.target == "aten.sum.default":
        return True
    rank = len(tensors[op.inputs[0]].shape)
    dims = _arg(op, 1, "dim", None)
    if dims in (None, (), []):
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return {d % rank for d in dims} == set(range(rank)) and not _arg(op, 2, "keepdim", False)


def _arg(op: Op, index: int, name: str, default):
    if index < len(op.args):
        return op.args[index]
    return op.kwargs_dict.get(name, default)


def _set_arg(op: Op, index: int, name: str, value) -> tuple[tuple, tuple]:
    if index < len(op.args):
        return op.args[:index] + (value,) + op.args[index + 1:], op.kwargs
    return op.args, tuple({**op.kwargs_dict, name: value}.items())


def _refs(value) -> Iterable[str]:
    if isinstance(value, TensorRef):
        yield value.name
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs(v)
