"""Shared by the tests of the annotation registry: run every part of a split op on slices of real
inputs, combine the parts, and compare with the whole op run by PyTorch (forward and gradients).

The oracle is the plain ATen call on whole tensors; the code under test is the annotation
(regions, value parts) and its lowering (the local call), never used to compute the reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ssdsl.ir.graph import Op, TensorInfo, TensorRef, map_tensor_refs
from ssdsl.ir.interpret import call_target
from ssdsl.ops import Annotation, Call


def make_call(target: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
              ) -> tuple[Call, dict[str, torch.Tensor]]:
    """A ``Call`` for ``target`` on concrete arguments, and the values of its tensors."""
    values: dict[str, torch.Tensor] = {}
    order: list[str] = []

    def ref(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            name = f"t{len(values)}"
            values[name] = v
            order.append(name)
            return TensorRef(name)
        if isinstance(v, (list, tuple)):
            return tuple(ref(x) for x in v)
        return v

    a = tuple(ref(x) for x in args)
    kw = tuple((k, ref(v)) for k, v in (kwargs or {}).items())
    # a copy: an in-place op must not change the values the parts are cut from
    out = call_target(target, map_tensor_refs(a, lambda r: values[r.name].clone()),
                      {k: map_tensor_refs(v, lambda r: values[r.name].clone()) for k, v in kw})
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    infos = {n: TensorInfo(n, tuple(v.shape), str(v.dtype)) for n, v in values.items()}
    out_names = tuple(f"out{i}" for i in range(len(outs)))
    infos.update({n: TensorInfo(n, tuple(o.shape), str(o.dtype)) for n, o in zip(out_names, outs)})
    op = Op(name="op", target=target, kind=target.split(".")[1], module="", args=a, kwargs=kw,
            inputs=tuple(order), outputs=out_names,
            returns="list" if isinstance(out, (list, tuple)) else "one")
    return Call(op, infos), values


def _index(region) -> list[torch.Tensor]:
    return [torch.cat([torch.arange(a, b) for a, b in dim]) for dim in region]


def take(t: torch.Tensor, region) -> torch.Tensor:
    for d, idx in enumerate(_index(region)):
        t = t.index_select(d, idx)
    return t


def put(acc: torch.Tensor, region, value: torch.Tensor) -> None:
    if acc.dim() == 0:
        acc.add_(value)
        return
    grid = torch.meshgrid(*_index(region), indexing="ij")
    acc.index_put_(grid, value, accumulate=True)


def _float(t: torch.Tensor) -> bool:
    """Whether the oracle differentiates ``t``: a float tensor not marked ``constant``."""
    return t.is_floating_point() and not getattr(t, "oracle_constant", False)


def constant(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked as an input the op takes no gradient for (a loss's class weight)."""
    t.oracle_constant = True
    return t


def operand(target: str, leaf: torch.Tensor) -> torch.Tensor:
    """What the call gets for input ``leaf``: an in-place op (``add_``) writes a copy, since
    autograd forbids writing a leaf that requires a gradient (the gradient reaches the leaf)."""
    return leaf.clone() if target.split(".")[1].endswith("_") else leaf


def run_whole(call: Call, values: Mapping[str, torch.Tensor], seed: int = 0):
    """Outputs and input gradients of the whole op (the oracle)."""
    ins = [values[n].detach().clone().requires_grad_(_float(values[n])) for n in call.op.inputs]
    # by position: a tensor passed twice (cat((x, x))) is two inputs with their own gradients
    order = iter([operand(call.op.target, x) for x in ins])
    args = map_tensor_refs(call.op.args, lambda r: next(order))
    kwargs = {k: map_tensor_refs(v, lambda r: next(order)) for k, v in call.op.kwargs}
    out = call_target(call.op.target, args, kwargs)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    g = torch.Generator().manual_seed(seed)
    gouts = [torch.randn(o.shape, generator=g, dtype=o.dtype) if _float(o) else None for o in outs]
    grads = _grads(outs, gouts, ins)
    return [o.detach() for o in outs], gouts, grads


def _grads(outs, gouts, ins) -> list[torch.Tensor | None]:
    pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None and o.requires_grad]
    wants = [i for i in ins if i.requires_grad]
    if not pairs or not wants:
        return [None] * len(ins)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wants, [g for _, g in pairs],
                                   allow_unused=True))
    return [next(got) if i.requires_grad else None for i in ins]


def check_parts(call: Call, ann: Annotation, values: Mapping[str, torch.Tensor],
                parts: Sequence[Mapping[str, tuple[int, int]]], *, atol: float = 1e-9) -> None:
    """Run every part (label ranges), combine, and compare with the whole op."""
    outs, gouts, grads = run_whole(call, values)
    assembled = [torch.zeros_like(o) for o in outs]
    grad_acc = [torch.zeros_like(g) if g is not None else None for g in grads]
    covered = [torch.zeros(o.shape, dtype=torch.int64) for o in outs]
    for ranges in parts:
        sub = ann.partition(call, ranges)
        full_ins = [values[n] for n in call.op.inputs]
        local = [take(v, r).detach().clone().requires_grad_(_float(v)) if r is not None else None
                 for v, r in zip(full_ins, sub.inputs)]
        args, kwargs = sub.local.bind([operand(call.op.target, x) if x is not None else None
                                       for x in local])
        out = call_target(sub.local.target, args, kwargs)
        louts = list(out) if isinstance(out, (list, tuple)) else [out]
        if sub.local.scale != 1.0:
            louts = [o * sub.local.scale for o in louts]
        for j, (o, r) in enumerate(zip(louts, sub.outputs)):
            assert tuple(o.shape) == tuple(take(outs[j], r).shape), (ranges, j)
            if sub.value:
                put(assembled[j], r, o.detach())
            else:
                assert torch.allclose(o.detach(), take(outs[j], r), atol=atol, rtol=1e-7), \
                    f"{call.op.target} part {dict(ranges)} output {j} differs"
                put(assembled[j], r, o.detach())
            put(covered[j], r, torch.ones_like(o, dtype=torch.int64))
        lg = [take(g, r) if g is not None else None for g, r in zip(gouts, sub.outputs)]
        lgrads = _grads(louts, lg, [x for x in local if x is not None])
        it = iter(lgrads)
        for i, x in enumerate(local):
            if x is None:
                continue
            gi = next(it)
            if gi is not None and grad_acc[i] is not None:
                put(grad_acc[i], sub.inputs[i], gi)
    for j, o in enumerate(outs):
        assert torch.allclose(assembled[j], o, atol=atol, rtol=1e-7), \
            f"{call.op.target}: combined output {j} differs from the whole op"
        if not any(ann.labels()[lab].mark == "reduced" for p in parts for lab in p):
            assert bool((covered[j] == 1).all()), "parts must cover every output element once"
    for i, (acc, g) in enumerate(zip(grad_acc, grads)):
        if g is not None:
            assert torch.allclose(acc, g, atol=atol, rtol=1e-6), \
                f"{call.op.target}: gradient of input {i} differs (parts {list(parts)[:1]}...)"


def equal_parts(ann: Annotation, label: str, n: int) -> list[dict[str, tuple[int, int]]]:
    size = ann.sizes()[label]
    step = size // n
    return [{label: (k * step, (k + 1) * step)} for k in range(n)]


def annotated_sample(samples: Mapping[str, Sequence[tuple]], target: str, index: int):
    """``(call, values, annotation)`` of sample ``index`` of ``target`` in ``samples`` (target ->
    [(args, kwargs, expected labels)]); the annotation must exist."""
    from ssdsl.ops import NotAnnotated, annotate_call
    args, kwargs, _ = samples[target][index]
    call, values = make_call(target, args, kwargs)
    ann = annotate_call(call)
    assert not isinstance(ann, NotAnnotated), ann
    return call, values, ann


def check_equal_splits(call: Call, ann: Annotation, values: Mapping[str, torch.Tensor],
                       counts: Sequence[int] = (2, 4)) -> None:
    """Every splittable label cut into each of ``counts`` equal parts that divide it: the parts
    combine to the whole op (``check_parts``)."""
    for label in ann.splittable():
        for n in counts:
            if ann.sizes()[label] % n == 0:
                check_parts(call, ann, values, equal_parts(ann, label, n))
