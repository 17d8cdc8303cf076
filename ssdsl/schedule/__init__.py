"""Phase 5, schedule: micro-batches, stages, units of work and the per-device program order.

- ``units``: ``Unit`` (``2F3``), ``Program``, ``StageGraph``, ``Schedule`` (graph-independent values);
- ``deps``: data dependencies between units from the stage DAG, cross-device ``Message``s;
- ``builders``: GPipe, 1F1B, interleaved 1F1B built in Python (oracles, defaults);
- ``simulate``: event simulation: timelines, bubble ratio, peak live activations;
- ``grid`` and ``picture``: text grids and SVG timelines;
- ``stages``: balanced contiguous stages from operator costs;
- ``lower``: elaborated microbatch/stages/assign/order directives to a ``Schedule``.

Checking a schedule (missing units, order against data, deadlock) is phase 6: ``ssdsl.check``.
"""
