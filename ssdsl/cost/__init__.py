"""Cost model: what a materialized plan costs on real devices, in seconds and bytes.

Phase 7b, after ``ssdsl.materialize`` (it reads the parts, the adapters and the schedule; nothing
before it depends on it):

- ``ssdsl.cost.ops``: FLOPs and bytes of each part of each operator, one rule per family;
- ``ssdsl.cost.profiles``: device profiles (V100, A100, H100 from datasheets; ``cpu`` measured by
  ``bench/bench_cost.py``) and the cluster shape (devices per node);
- ``ssdsl.cost.collectives``: alpha-beta times of ring/tree collectives and messages;
- ``ssdsl.cost.work``: per device and stage, a unit's compute and communication time and the
  activations it keeps; gradient reducer, optimizer and static memory;
- ``ssdsl.cost.simulate``: every rank's units in schedule order with their communication: step
  time, bubble, communication time, memory per device over time.

Example::

    cluster = Cluster(world=8, per_node=8)
    report = estimate(materialized, CostOptions(profile=profile("a100"), cluster=cluster))
    report.step_time, report.bubble, report.peak_memory

``docs/cost.md`` gives the formulas, the sources of the device numbers and the calibration.
"""

from ssdsl.cost.profiles import Cluster, DeviceProfile, profile, profile_names
from ssdsl.cost.simulate import CostReport, estimate, simulate_costs
from ssdsl.cost.work import CostOptions, plan_costs

__all__ = ["Cluster", "CostOptions", "CostReport", "DeviceProfile", "estimate", "plan_costs",
           "profile", "profile_names", "simulate_costs"]
