"""Operators that are known and can only be replicated, with the reason ``ssdsl trace`` shows."""

from ssdsl.ops.core import replicate_only

replicate_only("an assertion with no data output", "aten._assert_tensor_metadata.default",
               "aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default")
replicate_only("a scalar read from a tensor", "aten.item.default",
               "aten._local_scalar_dense.default")
