"""Phase 7, materialize: the communication that preserves every data dependency.

``plan_adapter`` decides, for one logical tensor, how its producers' placements become each
consumer's (collectives on a regular RVD path, point-to-point otherwise) and the adapter of its
gradients; ``plan_grad_reducer`` decides the gradient all-reduces of replicated weights, bucketed.
Execution lives in ``ssdsl.runtime.comm``; this phase only describes.
"""

from ssdsl.materialize.p2p import UncoveredRegion, plan_p2p
from ssdsl.materialize.reducer import (DEFAULT_BUCKET_BYTES, Bucket, GradReducer, Weight,
                                       plan_grad_reducer)
from ssdsl.materialize.plan import full_value, plan_adapter, plan_forward, plan_identity
from ssdsl.materialize.steps import (Adapter, AllGather, AllReduce, AllToAll, Chunk,
                                     CollectiveStep, Message, PointToPoint, ReduceScatter,
                                     ZeroSplit)

__all__ = [
    "DEFAULT_BUCKET_BYTES", "Bucket", "GradReducer", "Weight", "plan_grad_reducer",
    "Adapter", "AllGather", "AllReduce", "AllToAll", "Chunk", "CollectiveStep", "Message",
    "PointToPoint", "ReduceScatter", "UncoveredRegion", "ZeroSplit", "full_value", "plan_adapter",
    "plan_forward", "plan_identity", "plan_p2p",
]
