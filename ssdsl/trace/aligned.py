"""Indexing a dim by ``arange`` over its whole extent is no lookup: the dim is aligned.

Hugging Face mask builders (``sdpa_mask`` and friends) index per-batch tables with
``batch_arange[:, None, None, None]``, a ``torch.arange(batch_size)`` that pairs each output row
with the same row of the table: ``x[arange(N)[:, None, None], j]`` is ``x[:, j]`` with the
broadcast dims laid out as the index's. Read as a lookup, the indexed dim cannot be split (a
lookup reads the whole table), and the arange's values are positions in the whole batch, so a
micro-batch would need another arange than micro-batch 0. ``align_arange_indices`` rewrites

    y = index(x, [I, J1, ..., Jm])        I = arange(N) unsqueezed to (N, 1, ..., 1), N = x.shape[0]

into ``y = view(index(x, [None, J1, ..., Jm]), y.shape)`` when every ``Jk`` has the rank of
``I`` and size 1 in its leading dim (so the new op's shape ``(N, 1, ...)`` views as ``y``'s):
dim 0 of ``x`` then flows through as a plain dim (the batch), and the arange chain, used by
nothing else, is dropped.

A row pick, ``x[arange(N), j]`` with ``j`` of shape ``(N,)`` (row ``n`` of the result is
``x[n, j[n]]``: the pooling at the last or the end-of-text token of CLIP's text model and of
Hugging Face's ``*ForSequenceClassification``), pairs each row of ``x`` with one entry of ``j``:
it is rewritten into ``x.gather(1, j.view(N, 1, ...).expand(N, 1, *rest)).view(N, *rest)``, the
same values and gradients, whose dim 0 is shared by ``x``, ``j`` and the result (``gather``).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ssdsl.ir.graph import Op, TensorInfo, TensorRef, kind_of

_ARANGE = {"aten.arange.default", "aten.arange.start", "aten.arange.start_step"}
_UNSQUEEZE = {"aten.unsqueeze.default"}


def align_arange_indices(ops: list[Op], tensors: dict[str, TensorInfo]) -> list[Op]:
    """``ops`` with every aligned arange index rewritten (``tensors`` gains the new tensors)."""
    producer = {t: op for op in ops for t in op.outputs}
    out: list[Op] = []
    changed = False
    for op in ops:
        new = _rewrite(op, producer, tensors)
        changed |= new is not None
        out.extend(new or [op])
    return _drop_dead(out) if changed else ops


def _rewrite(op: Op, producer: Mapping[str, Op], tensors: dict[str, TensorInfo]
             ) -> list[Op] | None:
    if op.target != "aten.index.Tensor" or len(op.args) != 2 or op.kwargs:
        return None
    x, indices = op.args
    if not isinstance(x, TensorRef) or not indices or not all(
            isinstance(i, TensorRef) for i in indices):
        return None
    first, rest = indices[0], indices[1:]
    shape = tensors[first.name].shape
    n = tensors[x.name].shape[0]
    if not rest or shape[:1] != (n,) or any(s != 1 for s in shape[1:]) \
            or not _is_arange_of(first.name, n, producer):
        return None
    if len(rest) == 1 and shape == (n,) and tensors[rest[0].name].shape == (n,):
        return _row_pick(op, x, rest[0], tensors)
    if any(len(tensors[j.name].shape) != len(shape) or tensors[j.name].shape[0] != 1
           for j in rest):
        return None
    y = tensors[op.outputs[0]]
    mid = f"{op.name}_aligned"
    lookup_shape = (n, *_broadcast([tensors[j.name].shape for j in rest]))
    tensors[mid] = TensorInfo(mid, lookup_shape, y.dtype)
    lookup = attrs.evolve(op, name=mid, args=(x, (None, *rest)),
                          inputs=(x.name, *(j.name for j in rest)), outputs=(mid,))
    view = Op(name=op.name, target="aten.view.default", kind="view", module=op.module,
              args=(TensorRef(mid), tuple(y.shape)), inputs=(mid,), outputs=op.outputs)
    return [lookup, view]


def _row_pick(op: Op, x: TensorRef, j: TensorRef, tensors: dict[str, TensorInfo]
              ) -> list[Op] | None:
    """``x[arange(N), j]`` as a gather along dim 1 (module doc); None unless ``j`` holds int64
    indices (``gather`` takes no other) and ``x`` has a dim to pick from."""
    src, y = tensors[x.name], tensors[op.outputs[0]]
    if len(src.shape) < 2 or tensors[j.name].dtype != "torch.int64":
        return None
    n, rest = src.shape[0], tuple(src.shape[2:])
    names = [f"{op.name}_{k}" for k in ("rows", "wide", "picked")]
    tensors[names[0]] = TensorInfo(names[0], (n, 1, *(1 for _ in rest)), "torch.int64")
    tensors[names[1]] = TensorInfo(names[1], (n, 1, *rest), "torch.int64")
    tensors[names[2]] = TensorInfo(names[2], (n, 1, *rest), y.dtype)

    def made(name: str, target: str, args: tuple, ins: tuple[str, ...], out: str) -> Op:
        return attrs.evolve(op, name=name, target=target, kind=kind_of(target), args=args,
                            kwargs=(), inputs=ins, outputs=(out,), returns="one")
    return [made(names[0], "aten.view.default", (j, tensors[names[0]].shape), (j.name,),
                 names[0]),
            made(names[1], "aten.expand.default", (TensorRef(names[0]), tensors[names[1]].shape),
                 (names[0],), names[1]),
            made(names[2], "aten.gather.default", (x, 1, TensorRef(names[1])),
                 (x.name, names[1]), names[2]),
            made(op.name, "aten.view.default", (TensorRef(names[2]), tuple(y.shape)),
                 (names[2],), op.outputs[0])]


def _is_arange_of(name: str, n: int, producer: Mapping[str, Op]) -> bool:
    """Whether tensor ``name`` is ``arange(n)`` (start 0, step 1) with dims unsqueezed after."""
    op = producer.get(name)
    while op is not None and op.target in _UNSQUEEZE:  # the caller checked the final shape
        src = op.args[0]
        if not isinstance(src, TensorRef):
            return False
        op = producer.get(src.name)
    if op is None or op.target not in _ARANGE:
        return False
    args = [a for a in op.args if not isinstance(a, TensorRef)]
    kw = dict(op.kwargs)
    if op.target == "aten.arange.default":
        start, end, step = 0, args[0] if args else kw.get("end"), 1
    else:
        start, end = (args + [kw.get("start"), kw.get("end")])[:2]
        step = args[2] if len(args) > 2 else kw.get("step", 1)
    return (start, end, step) == (0, n, 1)


def _broadcast(shapes) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        sizes = {s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0} - {1}
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _drop_dead(ops: list[Op]) -> list[Op]:
    """``ops`` without the arange chains that no operator reads any more (only arange and
    unsqueeze ops are dropped: they have no effect besides their output)."""
    while True:
        used = {t for op in ops for t in op.inputs}
        dead = {op.name for op in ops if op.target in _ARANGE | _UNSQUEEZE
                and not any(t in used for t in op.outputs)}
        if not dead:
            return ops
        ops = [op for op in ops if op.name not in dead]
