"""Phase 4, transform: apply partition and replicate (and assign) to a traced graph.

>>> t = transform(graph, plan)            # graph from ssdsl.trace, plan from ssdsl.elaborate
>>> [p.device for p in t.parts["linear"]] # doctest: +SKIP
[0, 1]

Selectors are resolved against the graph here (``select``); a selector that matches nothing is an
error with the nearest module paths or kinds suggested.
"""

from __future__ import annotations

from ssdsl.elaborate.directives import ElaboratedPlan
from ssdsl.gcpause import gc_paused
from ssdsl.ir.graph import Graph
from ssdsl.transform.apply import apply_directives
from ssdsl.transform.errors import (
    BadDevice, EmptySelection, MissingDim, PartCountMismatch, TransformError, UnplacedPart,
)
from ssdsl.transform.parts import Part, Transformed

__all__ = ["transform", "Part", "Transformed", "TransformError", "EmptySelection", "MissingDim",
           "PartCountMismatch", "UnplacedPart", "BadDevice"]


@gc_paused()
def transform(graph: Graph, plan: ElaboratedPlan, *, require_placement: bool = True
              ) -> Transformed:
    """The parts of ``graph``'s operators under ``plan``'s partition, replicate and assign."""
    return apply_directives(graph, plan.directives, world=plan.world,
                            require_placement=require_placement)
