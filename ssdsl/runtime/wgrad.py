"""The weight half of a split backward (``BackwardWeight``) without an autograd walk per mixing
call, where the call's weight gradient has a known closed form.

A split backward's weight half takes, for each call that mixes the two sides (an activation and a
weight read through a weight cut), the cuts' gradients from the gradient its ``BackwardInput``
kept for the call's output. Asked of autograd, each is a graph task of its own: on the peers' GPT
(width 128, micro-batch 4 x 64) a linear's weight and bias cost 165 us that way against 86 us as
the two products below, and a stage of two blocks makes 12 such calls per micro-batch.

``rules_of(program)`` resolves, once per program, the call that made each mix's outputs (the last
``Call`` before the ``BackwardWeight`` that wrote them) and the rule for its operator:

- ``linear(x, w, b)``: ``dw = g^T x`` and ``db = sum g`` over the rows (``x`` and ``g`` as
  matrices of their last dimension): the products autograd's ``addmm``/``mm`` backward computes;
- ``layer_norm(x, shape, w, b, eps)`` / ``native_layer_norm``: ATen's own
  ``native_layer_norm_backward`` asked for the weight and bias only, from the mean and reciprocal
  deviation (``native_layer_norm``'s outputs where the call kept them, else computed again from
  ``x`` by the same kernel);
- ``conv1d``/``conv2d``/``conv3d``: ATen's ``convolution_backward`` asked for the weight and
  bias only, as autograd's backward of the convolution calls it;
- ``mm``, ``matmul`` (a matrix weight on the right of an activation of 2+ dimensions) and
  ``addmm`` (``beta = alpha = 1``): the matrix products of their backward;
- ``add``/``mul`` of an activation and a weight (a bias, a norm's scale): the output gradient
  (times the activation for ``mul``) summed to the weight's shape, as autograd's broadcasting
  backward does.

A ``layer_norm`` call keeps no statistics, so its rule would compute them again and call the
backward kernel a second time: with ``EARLY``, its cuts are asked of autograd in the input half
instead (``rules_of`` lists them under the ``BackwardInput`` that keeps the call's output), where
one kernel call gives the input's gradient and theirs; the weight half only hands them on.

Anything else (another operator, a cut activation, mixed dtypes, a gradient for a second output,
shapes that do not match) goes to autograd as before, per call. The formulas read the calls'
activation inputs, which ``BackwardWeight.reads`` lists for the checker. ``ENABLED = False``
leaves every call to autograd (benchmarks compare).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ssdsl.lower.instr import BackwardInput, BackwardWeight, Call, Program
from ssdsl.ops.core import Slot

# False: every mixing call's weight gradient through autograd (benchmarks compare)
ENABLED = True
# True: a layer norm's weight cuts get their gradients in the input half, from the backward
# kernel that computes the input's (one call; the weight half would compute the statistics
# again and call it a second time). False: in the weight half, by the rule (benchmarks compare)
EARLY = True

# (env, kept) -> [(cut, gradient)], or None: ask autograd
Rule = Callable[[dict, dict], "list[tuple[str, torch.Tensor]] | None"]

_aten = torch.ops.aten


def rules_of(program: Program) -> dict[int, tuple[Any, tuple]]:
    """``id(BackwardWeight) -> (it, one rule or None per mix)`` for ``program``, and
    ``id(BackwardInput) -> (it, cuts)``: the weight cuts whose gradients that input half asks
    autograd for itself (``EARLY``)."""
    writer: dict[str, Call] = {}
    keeper: dict[str, BackwardInput] = {}  # a kept output -> the input half that keeps it
    out: dict[int, tuple[Any, Any]] = {}
    for ins in program.instructions:
        if isinstance(ins, Call):
            for o in ins.outs:
                writer[o] = ins
        elif isinstance(ins, BackwardInput):
            for o in ins.keep:
                keeper[o] = ins
        elif isinstance(ins, BackwardWeight):
            rules = tuple(_rule(writer.get(outs[0]) if outs else None, outs, cuts)
                          for outs, cuts in ins.mixes)
            out[id(ins)] = (ins, rules)
            if not EARLY:
                continue
            for (outs, cuts), rule in zip(ins.mixes, rules):
                half = keeper.get(outs[0]) if outs else None
                if rule is None or not getattr(rule, "early", False) or half is None:
                    continue
                had = out.get(id(half))
                out[id(half)] = (half, (had[1] if had else ()) + tuple(c for c, _ in cuts))
    return out


def _named(call: Call) -> dict[str, Any] | None:
    """The call's arguments by schema name: ``("value", env name)`` for a tensor slot,
    ``("const", value)`` otherwise; None where the schema cannot be matched."""
    from ssdsl.ir.interpret import resolve_target
    try:
        schema = resolve_target(call.call.target)._schema
    except (AttributeError, ValueError):
        return None
    names = [a.name for a in schema.arguments]
    given = list(call.call.args)
    if len(given) > len(names):
        return None
    found: dict[str, Any] = {}
    for name, v in [*zip(names, given), *call.call.kwargs]:
        if isinstance(v, Slot):
            found[name] = ("value", call.ins[v.index])
        elif isinstance(v, (list, tuple)) and any(isinstance(x, Slot) for x in v):
            return None
        else:
            found[name] = ("const", v)
    for a in schema.arguments:
        if a.name not in found and a.has_default_value():
            found[a.name] = ("const", a.default_value)
    return found


def _rule(call: Call | None, outs: tuple[str, ...], cuts: tuple[tuple[str, str], ...]
          ) -> Rule | None:
    if call is None or tuple(call.outs) != tuple(outs):
        return None
    make = _MAKERS.get(call.call.target)
    args = _named(call) if make is not None else None
    if args is None:
        return None
    return make(args, {c for c, _ in cuts}, outs, call.call.scale)


def _value(args: dict, name: str) -> str | None:
    got = args.get(name)
    return got[1] if got is not None and got[0] == "value" and got[1] is not None else None


def _const(args: dict, name: str, default: Any = None) -> Any:
    got = args.get(name)
    return got[1] if got is not None and got[0] == "const" else default


def _grad(kept: dict, outs: tuple[str, ...], scale: float) -> torch.Tensor | None:
    """The gradient of the call's raw first output (the kept one, times the call's scale);
    None where another output has a kept gradient too (left to autograd)."""
    if any(o in kept for o in outs[1:]):
        return None
    g = kept.get(outs[0])
    if g is None:
        return None
    return g * scale if scale != 1.0 else g


def _wanted(env: dict, name: str | None, cuts: set[str]) -> bool:
    return name is not None and name in cuts and env[name].requires_grad


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


def _linear(args: dict, cuts: set[str], outs: tuple[str, ...], scale: float) -> Rule | None:
    x, w, b = _value(args, "input"), _value(args, "weight"), _value(args, "bias")
    if x is None or x in cuts or w is None or not ({w, b} & cuts):
        return None

    def rule(env: dict, kept: dict) -> list[tuple[str, torch.Tensor]] | None:
        g = _grad(kept, outs, scale)
        xv, wv = env[x], env[w]
        if g is None or wv.dim() != 2 or xv.dim() == 0 or not (g.dtype == xv.dtype == wv.dtype):
            return None
        g2 = _rows(g) if g.dim() != 1 else g.reshape(1, -1)
        got = []
        if _wanted(env, w, cuts):
            x2 = _rows(xv) if xv.dim() != 1 else xv.reshape(1, -1)
            got.append((w, g2.t().mm(x2)))
        if _wanted(env, b, cuts):
            got.append((b, g2.sum(0)))
        return got
    return rule


def _layer_norm(args: dict, cuts: set[str], outs: tuple[str, ...], scale: float,
                native: bool = False) -> Rule | None:
    x, w, b = _value(args, "input"), _value(args, "weight"), _value(args, "bias")
    shape, eps = _const(args, "normalized_shape"), _const(args, "eps")
    if x is None or x in cuts or not ({w, b} & cuts) or shape is None or eps is None:
        return None
    shape = list(shape)

    def rule(env: dict, kept: dict) -> list[tuple[str, torch.Tensor]] | None:
        g = _grad(kept, outs, scale)
        if g is None:
            return None
        xv = env[x]
        wv = env[w] if w is not None else None
        bv = env[b] if b is not None else None
        if native and len(outs) == 3 and outs[1] in env and outs[2] in env:
            mean, rstd = env[outs[1]], env[outs[2]]
        else:
            _, mean, rstd = _aten.native_layer_norm(xv, shape, None, None, eps)
        want_w, want_b = _wanted(env, w, cuts), _wanted(env, b, cuts)
        _, gw, gb = _aten.native_layer_norm_backward(g, xv, shape, mean, rstd, wv, bv,
                                                     [False, want_w, want_b])
        return ([(w, gw)] if want_w else []) + ([(b, gb)] if want_b else [])
    # its statistics are not kept (a ``layer_norm`` call, or a native one whose others outputs
    # are gone): the input half's own kernel call gives the cuts' gradients with the input's
    rule.early = not native  # type: ignore[attr-defined]
    return rule


def _native_layer_norm(args, cuts, outs, scale):
    return _layer_norm(args, cuts, outs, scale, native=True)


def _matrix(a: str | None, b: str | None, cuts: set[str], outs: tuple[str, ...], scale: float,
            batched: bool) -> Rule | None:
    """``a @ b`` with one of them a cut (a matrix), the other an activation; ``batched``:
    ``a`` may have leading dimensions (``matmul`` broadcasting ``b`` over them)."""
    if a is None or b is None or (a in cuts) == (b in cuts):
        return None

    def rule(env: dict, kept: dict) -> list[tuple[str, torch.Tensor]] | None:
        g = _grad(kept, outs, scale)
        av, bv = env[a], env[b]
        if g is None or not (g.dtype == av.dtype == bv.dtype) or bv.dim() != 2:
            return None
        if b in cuts:
            if av.dim() < 2 or (av.dim() > 2 and not batched):
                return None
            return [(b, _rows(av).t().mm(_rows(g)))] if env[b].requires_grad else []
        if av.dim() != 2 or g.dim() != 2:
            return None  # a cut on the left of a batched product: autograd
        return [(a, g.mm(bv.t()))] if env[a].requires_grad else []
    return rule


def _mm(args, cuts, outs, scale):
    return _matrix(_value(args, "self"), _value(args, "mat2"), cuts, outs, scale, False)


def _matmul(args, cuts, outs, scale):
    return _matrix(_value(args, "self"), _value(args, "other"), cuts, outs, scale, True)


def _addmm(args, cuts, outs, scale):
    bias, m1, m2 = _value(args, "self"), _value(args, "mat1"), _value(args, "mat2")
    if _const(args, "beta", 1) != 1 or _const(args, "alpha", 1) != 1:
        return None
    if bias is None or m1 is None or m2 is None or m1 in cuts or not ({bias, m2} & cuts):
        return None
    product = _matrix(m1, m2, cuts, outs, scale, False) if m2 in cuts else None

    def rule(env: dict, kept: dict) -> list[tuple[str, torch.Tensor]] | None:
        got: list[tuple[str, torch.Tensor]] = []
        if product is not None:
            part = product(env, kept)  # reads the kept gradient without taking it
            if part is None:
                return None
            got += part
        if _wanted(env, bias, cuts):
            g = _grad(kept, outs, scale)
            bv = env[bias]
            if g is None or g.dtype != bv.dtype:
                return None
            got.append((bias, g.sum_to_size(bv.shape)))
        return got
    return rule


def _elementwise(args: dict, cuts: set[str], outs: tuple[str, ...], scale: float,
                 times: bool) -> Rule | None:
    a, b = _value(args, "self"), _value(args, "other")
    if a is None or b is None or (a in cuts) == (b in cuts):
        return None
    if not times and _const(args, "alpha", 1) != 1:
        return None
    cut, other = (a, b) if a in cuts else (b, a)

    def rule(env: dict, kept: dict) -> list[tuple[str, torch.Tensor]] | None:
        g = _grad(kept, outs, scale)
        cv, ov = env[cut], env[other]
        if g is None or not isinstance(ov, torch.Tensor) or not (g.dtype == cv.dtype == ov.dtype):
            return None
        if not cv.requires_grad:
            return []
        full = g * ov if times else g
        try:
            return [(cut, full.sum_to_size(cv.shape))]
        except RuntimeError:  # the cut is not broadcast to the output's shape: autograd
            return None
    return rule


def _conv(args: dict, cuts: set[str], outs: tuple[str, ...], scale: float, dims: int
          ) -> Rule | None:
    """``conv{1,2,3}d(x, w, b, stride, padding, dilation, groups)``: ATen's own
    ``convolution_backward`` asked for the weight and bias only (the call autograd's backward of
    the convolution makes)."""
    x, w, b = _value(args, "input"), _value(args, "weight"), _value(args, "bias")
    if x is None or x in cuts or w is None or not ({w, b} & cuts):
        return None
    consts = [_const(args, k) for k in ("stride", "padding", "dilation", "groups")]
    if any(c is None or isinstance(c, str) for c in consts):
        return None  # a padding given by name ("same") is another overload: autograd
    stride, padding, dilation = (list(c) * (dims if len(c) == 1 else 1)
                                 if isinstance(c, (list, tuple)) else [c] * dims
                                 for c in consts[:3])
    groups = consts[3]

    def rule(env: dict, kept: dict) -> list[tuple[str, torch.Tensor]] | None:
        g = _grad(kept, outs, scale)
        xv, wv = env[x], env[w]
        if g is None or xv.dim() != dims + 2 or not (g.dtype == xv.dtype == wv.dtype):
            return None
        want_w, want_b = _wanted(env, w, cuts), _wanted(env, b, cuts)
        bias_sizes = [wv.shape[0]] if b is not None else None
        _, gw, gb = _aten.convolution_backward(g, xv, wv, bias_sizes, stride, padding, dilation,
                                               False, [0] * dims, groups,
                                               [False, want_w, want_b])
        return ([(w, gw)] if want_w else []) + ([(b, gb)] if want_b else [])
    return rule


def _add(args, cuts, outs, scale):
    return _elementwise(args, cuts, outs, scale, times=False)


def _mul(args, cuts, outs, scale):
    return _elementwise(args, cuts, outs, scale, times=True)


_MAKERS: dict[str, Callable[..., Rule | None]] = {
    "aten.linear.default": _linear,
    "aten.layer_norm.default": _layer_norm,
    "aten.native_layer_norm.default": _native_layer_norm,
    "aten.mm.default": _mm,
    "aten.matmul.default": _matmul,
    "aten.addmm.default": _addmm,
    "aten.conv1d.default": lambda *a: _conv(*a, dims=1),
    "aten.conv2d.default": lambda *a: _conv(*a, dims=2),
    "aten.conv3d.default": lambda *a: _conv(*a, dims=3),
    "aten.add.Tensor": _add,
    "aten.mul.Tensor": _mul,
}
