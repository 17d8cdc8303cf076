"""Parameters read by several operators: one graph tensor, read through one identity operator.

A parameter's gradient is the sum of the gradients of all its uses. The later phases keep one
local copy of a parameter region per device (a *leaf*) and sum leaves of equal regions across
devices; they do not sum the uses of one parameter that read it in different layouts (GPT's
``lm_head`` split along ``in`` while the tied token embedding reads the whole table), nor two
graph tensors that torch.export lists for one tied parameter (``wte.weight`` and
``lm_head.weight``). So the tracer rewrites every parameter used more than once into:

    %p  ->  share_p = aten.alias(%p)  ->  every former use of %p (or of a tied name of p)

The parameter then has exactly one reader, and the alias's output is an ordinary activation:
each consumer gets its layout through an adapter, and the backward adapters plus autograd sum
the consumers' gradient contributions whatever their layouts, exactly as for any activation
read twice. Under data parallelism the alias is a replica whose partial output gradients end at
the weight, so the sum still rides in the weight's gradient bucket.

An operator whose outputs the loss does not differentiate (``frozen``: a recycling pass before
its ``.detach()``) reads the parameter itself and is no use here: it adds no gradient, and an
alias placed before it would put a gradient-carrying operator into a pass that has no backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from ssdsl.ir.graph import Op, TensorInfo, TensorRef, map_tensor_refs

SHARE_PREFIX = "share_"


def share_parameters(ops: list[Op], tensors: dict[str, TensorInfo], params: dict[str, str],
                     aliases: Mapping[str, tuple[str, ...]],
                     frozen: frozenset[str] = frozenset()) -> list[Op]:
    """``ops`` with every parameter used more than once read through one alias op.

    Tied graph tensors (qualified names in ``aliases``) become one: the first one in ``params``
    stays, the others are removed from ``params`` and ``tensors`` (in place).
    """
    groups = _tied_groups(params, aliases)
    uses = _use_counts(op for op in ops if op.name not in frozen)
    rename: dict[str, str] = {}
    inserts: dict[str, list[Op]] = {}  # the first op reading a group -> alias ops before it
    for main, members in groups.items():
        if sum(uses.get(t, 0) for t in members) < 2:
            continue
        shared = _fresh(f"{SHARE_PREFIX}{main}", tensors)
        tensors[shared] = attrs.evolve(tensors[main], name=shared)
        for t in members:
            rename[t] = shared
        first = next(op for op in ops if op.name not in frozen
                     and any(t in members for t in op.inputs))
        inserts.setdefault(first.name, []).append(Op(
            name=_fresh(f"{SHARE_PREFIX}{main}", {o.name for o in ops}),
            target="aten.alias.default", kind="alias", module=params[main].rpartition(".")[0],
            args=(TensorRef(main),), inputs=(main,), outputs=(shared,)))
        for t in members[1:]:
            del params[t]
            tensors.pop(t, None)
    if not rename:
        return ops
    members_main = {t: ms[0] for ms in groups.values() for t in ms[1:] if t in rename}
    out: list[Op] = []
    for op in ops:
        out += inserts.get(op.name, [])
        # a frozen reader of a tied name reads the kept one (removed names are gone)
        out.append(_renamed(op, rename if op.name not in frozen else
                            {t: members_main[t] for t in op.inputs if t in members_main}))
    return out


def _tied_groups(params: Mapping[str, str], aliases: Mapping[str, tuple[str, ...]]
                 ) -> dict[str, list[str]]:
    """First graph tensor of each parameter -> every graph tensor of that parameter."""
    by_qual: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for tensor, qual in params.items():
        main = next((by_qual[q] for q in (qual, *aliases.get(qual, ())) if q in by_qual), None)
        if main is None:
            main = tensor
            groups[main] = []
        groups[main].append(tensor)
        by_qual[qual] = main
    return groups


def _use_counts(ops: Iterable[Op]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ops:
        for t in op.inputs:
            counts[t] = counts.get(t, 0) + 1
    return counts


def _fresh(base: str, taken) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def _renamed(op: Op, rename: Mapping[str, str]) -> Op:
    if not any(t in rename for t in op.inputs):
        return op
    sub = lambda ref: TensorRef(rename.get(ref.name, ref.name))  # noqa: E731
    return Op(name=op.name, target=op.target, kind=op.kind, module=op.module,
              args=map_tensor_refs(op.args, sub),
              kwargs=tuple((k, map_tensor_refs(v, sub)) for k, v in op.kwargs),
              inputs=tuple(rename.get(t, t) for t in op.inputs), outputs=op.outputs,
              returns=op.returns, calls=op.calls)
