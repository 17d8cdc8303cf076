"""The operator annotation registry: how each ATen operator may be partitioned.

Vocabulary: a *dim* is a tensor dimension; a *label* is an op-local name for an index space, like
an einsum letter; a dim is one label or several (a *merged* dim, ``(3 h d)``, outermost first);
a *flowing name* is a graph-wide dim name (``batch``, ``seq``, ``heads``) the tracer attaches.

Using it (the transform phase)::

    from ssdsl.ops import annotate, require

    ann = annotate(graph, op)              # Annotation, or NotAnnotated(reason)
    ann = require(ann, op)                 # raises NotAnnotatedError naming the op
    ann.labels()                           # {label: Label(name, size, mark, reason)}
    label = ann.label_for("heads")         # label carrying a flowing name, or None
    part = ann.split(call_of(graph, op), label, 4, k)   # part k of 4  (-> SubOp)
    part.inputs[i]     # region of op.inputs[i]: per dim a tuple of (start, stop); None = unused
    part.outputs[j]    # region of op.outputs[j]
    part.value         # reduced labels this part covers partly: outputs are partial sums
    args, kwargs = part.local.bind(local_input_tensors)      # Slot(i) -> the i-th input's piece
    out = call_target(part.local.target, args, kwargs) * part.local.scale

- Marks: *spatial* labels appear in outputs (a part computes a slice of every output);
  *reduced* labels appear only in inputs (parts give partial sums that add up to the output);
  *frozen* labels cannot be split; ``Label.reason`` says why (softmax, layer norm, causal mask...).
- A strided region: splitting ``h`` of a dim ``(3 h d)`` covers one interval per index of the
  ``3``. ``annotate(graph, op)`` already cuts labels into the factors that the graph's flowing
  names need (``Annotation.refined``), so the ``n`` of the fused QKV linear is ``(n.0 n.1 n.2)``
  with ``n.1`` named ``heads``.
- Nested partitions (2-D plans): ``ann.partition(call, {label: (start, stop), ...})`` covers any
  set of label ranges at once; ``split`` is the equal-parts shorthand.
- Lowering: ``SubOp.local`` is the ATen call on local pieces: size arguments of ``view``,
  ``reshape``, ``expand``, ``split`` follow the local shapes, ``arange`` makes its own range,
  ``sdpa``'s scale is pinned to the full op's value, a bias is kept only by part 0 of a value
  split, and a mean's parts are scaled by their share (``scale``) so that parts sum to the mean
  (cross-entropy's batch split likewise).
- Adding operators: one file per family (``elementwise``, ``matmul``, ``reduction``, ``shape``,
  ``attention``, ``embedding``, ``normalization``, ``loss``, ``convolution``, ``creation``,
  ``pooling``, ``fft``), each
  rule a function ``Call -> Annotation`` under ``@register("aten.<op>.<overload>", ...)``; ops that
  can only be replicated are listed with a reason by ``replicate_only`` (``replicate.py``).
"""

from __future__ import annotations

from ssdsl.ops import (  # noqa: F401  (filling the registry)
    attention, convolution, creation, elementwise, embedding, fft, loss, matmul, normalization,
    padding, pooling, recurrent, reduction, replicate, shape,
)
from ssdsl.ops.annotate import annotate, call_of, label_for_name
from ssdsl.ops.core import (
    Annotation, Call, Factor, Label, LocalCall, NotAnnotated, Region, Slot, SubOp,
    annotate_call, dim_intervals, local_shape, region_of, register, registered,
    replicate_only, replicate_only_ops, require,
)
from ssdsl.ops.errors import (
    FrozenDimError, IndivisibleError, NotAnnotatedError, OpsError, UnknownDimError,
)

__all__ = [
    "Annotation", "Call", "Factor", "Label", "LocalCall", "NotAnnotated", "Region", "Slot",
    "SubOp", "annotate", "annotate_call", "call_of", "dim_intervals", "label_for_name",
    "local_shape", "region_of", "register", "registered", "replicate_only", "replicate_only_ops",
    "require", "FrozenDimError", "IndivisibleError", "NotAnnotatedError", "OpsError",
    "UnknownDimError",
]
