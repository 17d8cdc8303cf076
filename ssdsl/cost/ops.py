"""Work of one part of one operator: FLOPs and bytes moved, forward and backward.

The rules read the operator's annotation (its labels and their sizes, narrowed to the part's
ranges) and the regions the part reads and writes; one rule per operator family, registered by
ATen name with ``@cost_rule`` as annotations are with ``ssdsl.ops.register``:

- *matmul-like* (linear, matmul, mm, bmm, addmm, baddbmm, einsum): ``2 * prod(label sizes)``, the
  textbook ``2 M N K`` with batch dims; backward twice the forward (the input and the weight
  gradient are one product each);
- *convolution*: the same over ``(N, groups, Co/groups, Ci/groups, output positions, kernel)``;
  backward twice;
- *attention* (sdpa): its two products, ``2 B H L S (E + Ev)``, half of them under a causal
  mask where the kernel skips the masked blocks (``DeviceProfile.skips_causal``); backward twice,
  plus one more ``Q K^T`` where a fused kernel recomputes the scores
  (``DeviceProfile.flash_attention``); without a fused kernel the ``B H L S`` score matrix is
  written and read (bytes); it runs at the attention rate (``DeviceProfile.attention_rate``);
- *views* (view, reshape, transpose, permute, split, expand, select, slice, ...): no work
  forward; backward, the pieces of a split are concatenated (their bytes written into the
  input's gradient), a slice or a select writes a zero gradient of the whole input and copies
  the piece into it, an expand sums over the expanded dims;
- everything else (elementwise, normalization, softmax, reductions, embedding, losses, copies):
  memory-bound, the bytes of the part's inputs and outputs, a few FLOPs per output element;
  backward reads the output gradient and what was saved and writes the input gradient: twice the
  forward bytes.

``saved`` is the activation bytes a part keeps for backward beyond its inputs (the score matrix
of an unfused attention, the log-probabilities of a cross-entropy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs

from ssdsl.ir.graph import Graph, Op
from ssdsl.ops import Annotation
from ssdsl.ops.macs import (ATTENTION, CONVOLUTIONS, MATMULS, TRANSPOSED, aten_name,
                             multiply_adds)
from ssdsl.transform.parts import Part

VIEW_KINDS = frozenset({
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze",
    "permute", "transpose", "t", "split", "chunk", "split_with_sizes", "unbind", "select",
    "slice", "expand", "alias", "detach", "lift_fresh_copy", "as_strided", "view_as",
})


@attrs.frozen
class Work:
    """FLOPs and bytes of one part, forward and backward, and the extra activation bytes kept."""

    flops: float = 0.0
    bytes: float = 0.0
    bwd_flops: float = 0.0
    bwd_bytes: float = 0.0
    saved: float = 0.0
    view: bool = False
    matmul: bool = False  # runs at the matrix rate (else the vector/memory rate)
    attention: bool = False  # runs at the attention rate
    scores: float = 0.0      # an attention's score elements per head (L S): a rate curve's size

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes,
                    self.bwd_flops + other.bwd_flops, self.bwd_bytes + other.bwd_bytes,
                    self.saved + other.saved)


@attrs.frozen
class OpContext:
    """What a rule sees: the op, its annotation (or None), the part's label sizes and bytes."""

    op: Op
    ann: Annotation | None
    sizes: Mapping[str, int]
    in_bytes: tuple[float, ...]   # per input slot the part reads (0 for slots it does not)
    out_bytes: tuple[float, ...]
    out_numel: float
    itemsize: int
    flash: bool
    causal_skip: bool = False


Rule = Callable[[OpContext], Work]
_RULES: dict[str, Rule] = {}


def cost_rule(*kinds: str) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the cost rule of the ATen operator names ``kinds`` (``"linear"``)."""
    def deco(fn: Rule) -> Rule:
        for k in kinds:
            _RULES[k] = fn
        return fn
    return deco


@cost_rule(*MATMULS)
def matmul_work(c: OpContext) -> Work:
    flops = 2.0 * multiply_adds("linear", c.sizes)
    moved = sum(c.in_bytes) + sum(c.out_bytes)
    return Work(flops, moved, 2 * flops, 2 * moved, matmul=True)


@cost_rule(*CONVOLUTIONS)
def conv_work(c: OpContext) -> Work:
    # the iteration space: batch, groups, output and input channels per group, output positions,
    # kernel offsets (``ssdsl.ops.macs``)
    flops = 2.0 * multiply_adds("convolution", c.sizes)
    moved = sum(c.in_bytes) + sum(c.out_bytes)
    return Work(flops, moved, 2 * flops, 2 * moved, matmul=True)


@cost_rule(*TRANSPOSED)
def conv_transpose_work(c: OpContext) -> Work:
    # batch, channels, input positions, kernel offsets (``ssdsl.ops.macs``)
    flops = 2.0 * multiply_adds("conv_transpose2d", c.sizes)
    moved = sum(c.in_bytes) + sum(c.out_bytes)
    return Work(flops, moved, 2 * flops, 2 * moved, matmul=True)


@cost_rule(ATTENTION)
def sdpa_work(c: OpContext) -> Work:
    # a label may be split into pieces (``E.0``, ``E.1``: the trace factored the dim, as a
    # rotary embedding's halves do): ``ssdsl.ops.macs`` groups them
    qk_macs, pv_macs = multiply_adds(ATTENTION, c.sizes)
    L, S = (math.prod(v for k, v in c.sizes.items() if k.split(".")[0] == root)
            for root in ("L", "S"))
    causal = bool(c.op.kwargs_dict.get("is_causal", c.op.args[5] if len(c.op.args) > 5
                                       else False))
    share = 0.5 if (causal and c.causal_skip) else 1.0
    qk, pv = 2.0 * qk_macs * share, 2.0 * pv_macs * share
    scores = qk_macs / max(1, math.prod(v for k, v in c.sizes.items()
                                        if k.split(".")[0] == "E"))
    moved = sum(c.in_bytes) + sum(c.out_bytes)
    saved = 0.0
    if not c.flash:  # the math path writes the scores, softmaxes them, reads them for P V
        moved += 3 * scores * c.itemsize
        saved = scores * c.itemsize
    bwd = 2 * (qk + pv) + (qk if c.flash else 0.0)
    return Work(qk + pv, moved, bwd, 2 * moved, saved=saved, matmul=True, attention=True,
                scores=float(L * S))


@cost_rule("cross_entropy_loss", "nll_loss")
def loss_work(c: OpContext) -> Work:
    logits = c.in_bytes[0] if c.in_bytes else 0.0
    # log-softmax over the classes: read, write, read again for the gather; kept for backward.
    # Backward: the NLL gradient is a zero tensor of the logits' shape with one entry a row
    # (written), and the log-softmax backward reads it and the kept output and writes the
    # logits' gradient (an exp an element).
    elements = logits / c.itemsize
    return Work(5.0 * elements, 3 * logits, 5.0 * elements, 4 * logits, saved=logits)


@cost_rule("embedding")
def embedding_work(c: OpContext) -> Work:
    out = sum(c.out_bytes)
    # backward zeroes the weight gradient and adds each row of the output gradient into it
    weight = c.in_bytes[0] if c.in_bytes else 0.0
    return Work(0.0, 2 * out, 0.0, 2 * out + weight)


def _memory_bound(c: OpContext) -> Work:
    moved = sum(c.in_bytes) + sum(c.out_bytes)
    return Work(4.0 * c.out_numel, moved, 8.0 * c.out_numel, 2 * moved)


# views whose backward writes memory (module doc): split-like ones concatenate the pieces'
# gradients; a slice or a select scatters its piece into a zero gradient of the whole input; an
# expand sums the gradient over the expanded dims
SPLIT_VIEWS = frozenset({"split", "chunk", "split_with_sizes", "unbind"})
PIECE_VIEWS = frozenset({"slice", "select"})


def work_of(graph: Graph, op: Op, ann: Annotation | None, part: Part, *, itemsize: int,
            flash: bool, causal_skip: bool | None = None) -> Work:
    """The ``Work`` of ``part`` of ``op`` with floats of ``itemsize`` bytes (``causal_skip``:
    ``None`` is ``flash``)."""
    name = aten_name(op.target)
    if name in VIEW_KINDS:
        return _view_work(graph, op, part, name, itemsize)
    sizes = dict(ann.sizes()) if ann is not None else {}
    for label, (start, stop) in part.ranges:
        sizes[label] = stop - start
    ins = tuple(_bytes(graph, t, r, itemsize) if r is not None else 0.0
                for t, r in zip(op.inputs, part.sub.inputs))
    outs = tuple(_bytes(graph, t, r, itemsize) for t, r in zip(op.outputs, part.sub.outputs))
    numel = float(sum(region_numel(r) for r in part.sub.outputs))
    ctx = OpContext(op, ann, sizes, ins, outs, numel, itemsize, flash,
                    flash if causal_skip is None else causal_skip)
    rule = _RULES.get(name)
    if rule is None or (ann is None and rule is not loss_work):
        return _memory_bound(ctx)
    return rule(ctx)


def _view_work(graph: Graph, op: Op, part: Part, name: str, itemsize: int) -> Work:
    if name in SPLIT_VIEWS:
        out = sum(_bytes(graph, t, r, itemsize) for t, r in zip(op.outputs, part.sub.outputs))
        return Work(bwd_bytes=2 * out, view=True)
    if name in PIECE_VIEWS or name == "expand":
        r_in = part.sub.inputs[0] if part.sub.inputs else None
        whole = _bytes(graph, op.inputs[0], r_in, itemsize) if r_in is not None else 0.0
        out = sum(_bytes(graph, t, r, itemsize) for t, r in zip(op.outputs, part.sub.outputs))
        if name == "expand":  # read the expanded gradient, write the input's
            return Work(bwd_bytes=out + whole, view=True)
        return Work(bwd_bytes=whole + 2 * out, view=True)
    return Work(view=True)


def region_numel(region) -> int:
    """Elements of a region (a product over its dims of the lengths of their pieces)."""
    return math.prod(sum(b - a for a, b in dim) for dim in region)


def item_bytes(graph: Graph, tensor: str, float_itemsize: int) -> int:
    """Bytes per element of ``tensor``: the run's float size for floats, else its own dtype's."""
    dtype = graph.tensors[tensor].dtype
    if "float" in dtype or "complex" in dtype:
        return float_itemsize
    if "bool" in dtype or "int8" in dtype or "uint8" in dtype:
        return 1
    if "int16" in dtype:
        return 2
    if "int32" in dtype:
        return 4
    return 8


def _bytes(graph: Graph, tensor: str, region, itemsize: int) -> float:
    return float(region_numel(region) * item_bytes(graph, tensor, itemsize))


# ---------------------------------------------------------------- what a backward keeps

# Which tensors autograd keeps from an operator's forward for its backward (PyTorch's derivative
# formulas): a sum, a copy or a concatenation keeps none; an activation function keeps its
# input (or its output, where the derivative is written in the output); a product keeps each
# operand that another operand's gradient needs. Operators not named here keep every float
# input, an upper bound.
KEEPS_NOTHING = frozenset({
    "add", "sub", "neg", "sum", "mean", "cat", "stack", "roll", "clone", "contiguous", "to",
    "_to_copy", "type_as", "repeat", "pad", "constant_pad_nd", "flip", "cumsum", "zeros_like",
    "ones_like", "new_ones", "new_zeros", "arange", "full", "zeros", "ones", "fill",
    "masked_fill", "where", "index", "gather", "embedding", "cross_entropy_loss", "nll_loss",
    "dropout", "native_dropout", "tril", "triu", "diff",  # (a dropout's mask: ``mask_bytes``)
})
KEEPS_OUTPUT = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "tanh", "sigmoid",
                          "exp", "rsqrt", "sqrt", "relu", "scaled_dot_product_attention"})
KEEPS_FIRST = frozenset({"gelu", "silu", "pow", "layer_norm", "rms_norm", "group_norm",
                         "batch_norm", "sin", "cos", "log", "abs", "erf", "reciprocal",
                         "hardswish", "mish", "elu", "leaky_relu", "softplus", "max_pool2d",
                         "avg_pool2d", "adaptive_avg_pool2d"})
PRODUCTS = frozenset({"linear", "matmul", "mm", "bmm", "mul", "einsum", "conv1d", "conv2d",
                      "conv3d", "convolution", "div"})


def kept_slots(op: Op, needs_grad) -> tuple[tuple[int, ...], bool]:
    """(input slots whose tensors autograd keeps for ``op``'s backward, whether it keeps the
    outputs); ``needs_grad(tensor)`` says whether a tensor's gradient is computed."""
    name = aten_name(op.target)
    n = len(op.inputs)
    if name in KEEPS_NOTHING:
        return (), False
    if name == "scaled_dot_product_attention":  # q, k, v and the output (and its row maxima)
        return tuple(range(min(3, n))), True
    if name in KEEPS_OUTPUT:
        return (), True
    if name in KEEPS_FIRST:
        return ((0,) if n else ()), False
    if name in ("addmm", "baddbmm"):  # the bias (slot 0) is added: kept is what multiplies
        return tuple(i for i in (1, 2) if i < n and needs_grad(op.inputs[3 - i])), False
    if name in PRODUCTS:
        if name == "div":  # a / b: b for a's gradient; a and b for b's
            kept = {1} | ({0} if n > 1 and needs_grad(op.inputs[1]) else set())
            return tuple(sorted(i for i in kept if i < n)), False
        # each operand that another operand's gradient needs (the bias of a linear: none)
        operands = range(min(n, 2))
        return tuple(i for i in operands
                     if any(needs_grad(op.inputs[j]) for j in operands if j != i)), False
    return tuple(range(n)), False


def mask_bytes(op: Op, out_numel: float) -> float:
    """Bytes of the mask a training dropout keeps (one byte an element; none at p = 0)."""
    if aten_name(op.target) not in ("dropout", "native_dropout"):
        return 0.0
    prob = op.args[1] if len(op.args) > 1 else op.kwargs_dict.get("p", 0.5)
    train = op.args[2] if len(op.args) > 2 else op.kwargs_dict.get("train", True)
    return out_numel if isinstance(prob, (int, float)) and prob > 0 and train else 0.0
