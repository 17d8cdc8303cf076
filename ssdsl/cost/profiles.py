"""Device profiles: what one accelerator and its links can do, and how devices are grouped into nodes.

Every number of the GPU profiles comes from a vendor datasheet; ``docs/cost.md`` names the source
of each. Two kinds of number are not datasheet figures and are marked as assumptions there: the
*efficiency* factors (the share of peak a well-shaped kernel reaches) and the latencies (a
collective's fixed cost per step, which NCCL does not publish per device).

The ``cpu`` profile is measured on the machine that runs the benchmark (``bench/bench_cost.py``
writes ``ssdsl/cost/cpu.json``); without that file a conservative default is used and says so.

Example::

    >>> a100 = profile("a100")
    >>> a100.peak_flops("bfloat16") / 1e12
    312.0
    >>> Cluster(world=16, per_node=8).node_of(9)
    1
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

from ssdsl.errors import SsdslError

GB = 1e9
TFLOPS = 1e12
CPU_PROFILE_FILE = Path(__file__).with_name("cpu.json")


class UnknownDevice(SsdslError):
    """``--device`` names no profile."""


class UnsupportedDtype(SsdslError):
    """The profile has no peak rate for the dtype asked for."""


def _points(value: Any) -> tuple[tuple[float, float], ...]:
    """Curve points from a profile file (lists) or code (tuples), sorted by size."""
    return tuple(sorted((float(x), float(y)) for x, y in value or ()))


@attrs.frozen(kw_only=True)
class DeviceProfile:
    """One device kind.

    Rates are per device and per direction, in SI units (FLOP/s, bytes/s, seconds).
    ``intra_bw``/``intra_latency``: a link between two devices of one node (NVLink);
    ``inter_bw``/``inter_latency``: the network a node has to other nodes (all its NICs together),
    shared by the rings that cross it. ``compute_efficiency`` and ``memory_efficiency`` scale peak
    to what kernels reach; ``op_overhead``: fixed time per operator call (kernel launch, or eager
    dispatch on a CPU), ``view_overhead`` the same for an operator that moves no data (a view),
    ``param_overhead`` the optimizer's per tensor.
    ``flash_attention``: attention kernels are fused: they keep no score matrix (the math path
    writes and keeps it). ``causal_skip``: a fused kernel skips the masked half under a causal
    mask (``None``: as ``flash_attention``; PyTorch's CPU kernel, measured, does not).
    ``attention_efficiency``: the share of peak an attention kernel reaches (``None``: the
    matrix kernels' ``compute_efficiency``); its products are many small ones, one per head, so
    on a CPU it is far below a large matrix product's rate.
    ``exchange_bytes``: sum all-reduces whose member sends at most this many bytes in all (its
    tensor's bytes times ``ssdsl.cost.collectives.exchange_rounds``) run as pairwise exchanges,
    as ``ssdsl.runtime.exchange`` runs them on gloo (0: none; NCCL picks ring or tree);
    ``exchange_latency`` the fixed cost of one round of them (a send and a receive at once;
    None: the link's latency).
    ``comm_overlap``: the share of a collective's time that compute running beside it hides
    (gradient buckets reduced during the last backward): GPUs run NCCL beside the kernels
    (an assumption: 1); on a CPU gloo takes the cores the backward runs on (measured).
    Measured profiles may give curves instead of one share: ``matmul_curve``, ``(FLOPs of one
    product, share of peak)`` points (a small product runs below a large one's rate), and
    ``attention_curve``, ``(score elements per head, L S; share of peak)`` points (short
    sequences run below long ones' rate); between points the share is
    interpolated in the logarithm of the size, beyond the ends it is the end's.
    """

    name: str
    peak: MappingProxyType = attrs.field(converter=MappingProxyType)  # dtype -> FLOP/s
    memory: float            # bytes
    memory_bw: float         # bytes/s
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    per_node: int            # devices one node usually has
    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    op_overhead: float = 0.0
    view_overhead: float = 0.0
    param_overhead: float = 1e-6  # per parameter tensor and optimizer state in the step
    flash_attention: bool = False
    comm_overlap: float = 1.0
    exchange_bytes: float = 0.0
    exchange_latency: float | None = None
    causal_skip: bool | None = None
    attention_efficiency: float | None = None
    matmul_curve: tuple[tuple[float, float], ...] = attrs.field(default=(), converter=_points)
    attention_curve: tuple[tuple[float, float], ...] = attrs.field(default=(),
                                                                   converter=_points)
    source: str = "datasheet"

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (``"float32"``, ``"bfloat16"``, ...)."""
        found = self.peak.get(_dtype_name(dtype))
        if found is None:
            raise UnsupportedDtype(f"device profile '{self.name}' has no peak rate for {dtype}",
                                   hint=f"choose one of {', '.join(sorted(self.peak))}")
        return float(found)

    def flops_rate(self, dtype: str, flops: float | None = None) -> float:
        """FLOP/s a matrix kernel reaches: peak times the compute efficiency, or times the
        ``matmul_curve``'s share for a product of ``flops``."""
        if self.matmul_curve and flops:
            return self.peak_flops(dtype) * _on_curve(self.matmul_curve, flops)
        return self.peak_flops(dtype) * self.compute_efficiency

    def attention_rate(self, dtype: str, scores: float | None = None) -> float:
        """FLOP/s an attention kernel reaches (its products counted as ``ssdsl.cost.ops`` does),
        on the ``attention_curve`` at ``scores`` score elements per head if the profile has one."""
        if self.attention_curve and scores:
            return self.peak_flops(dtype) * _on_curve(self.attention_curve, scores)
        share = self.compute_efficiency if self.attention_efficiency is None \
            else self.attention_efficiency
        return self.peak_flops(dtype) * share

    @property
    def skips_causal(self) -> bool:
        """Whether attention under a causal mask does half the products."""
        return self.flash_attention if self.causal_skip is None else self.causal_skip

    def bytes_rate(self) -> float:
        """Bytes/s a memory-bound kernel reaches."""
        return self.memory_bw * self.memory_efficiency

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["peak"] = dict(self.peak)
        return d


def _on_curve(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The share at ``x``: interpolated in log x between the points, the end's beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return y0 + f * (y1 - y0)
    return points[-1][1]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class Cluster:
    """``world`` devices, ``per_node`` of them on each node, numbered node by node."""

    world: int
    per_node: int

    def node_of(self, device: int) -> int:
        return device // self.per_node

    def nodes_of(self, devices: Any) -> frozenset[int]:
        return frozenset(self.node_of(d) for d in devices)

    @property
    def nodes(self) -> int:
        return -(-self.world // self.per_node)


# Datasheet figures (docs/cost.md gives each source). Per-direction link rates: NVLink
# datasheets quote both directions together, so they are halved here.
V100 = DeviceProfile(
    name="v100", peak={"float64": 7.8 * TFLOPS, "float32": 15.7 * TFLOPS,
                       "float16": 125 * TFLOPS},
    memory=32 * GB, memory_bw=900 * GB, intra_bw=150 * GB, intra_latency=10e-6,
    inter_bw=12.5 * GB, inter_latency=20e-6, per_node=8,
    compute_efficiency=0.7, memory_efficiency=0.8, op_overhead=5e-6, flash_attention=False,
    source="NVIDIA V100 datasheet (SXM2 32 GB), NVLink 2.0, InfiniBand EDR 100 Gb/s per node")
A100 = DeviceProfile(
    name="a100", peak={"float64": 19.5 * TFLOPS, "float32": 19.5 * TFLOPS,
                       "tfloat32": 156 * TFLOPS, "float16": 312 * TFLOPS,
                       "bfloat16": 312 * TFLOPS},
    memory=80 * GB, memory_bw=2039 * GB, intra_bw=300 * GB, intra_latency=10e-6,
    inter_bw=200 * GB, inter_latency=20e-6, per_node=8,
    compute_efficiency=0.7, memory_efficiency=0.8, op_overhead=5e-6, flash_attention=True,
    source="NVIDIA A100 datasheet (SXM4 80 GB), NVLink 3.0, 8 x InfiniBand HDR 200 Gb/s per node")
H100 = DeviceProfile(
    name="h100", peak={"float64": 67 * TFLOPS, "float32": 67 * TFLOPS,
                       "tfloat32": 494.5 * TFLOPS, "float16": 989.5 * TFLOPS,
                       "bfloat16": 989.5 * TFLOPS},
    memory=80 * GB, memory_bw=3350 * GB, intra_bw=450 * GB, intra_latency=10e-6,
    inter_bw=400 * GB, inter_latency=20e-6, per_node=8,
    compute_efficiency=0.7, memory_efficiency=0.8, op_overhead=5e-6, flash_attention=True,
    source="NVIDIA H100 datasheet (SXM5 80 GB), NVLink 4.0, 8 x InfiniBand NDR 400 Gb/s per node")

# Used only when bench/bench_cost.py has not measured this machine: a small CPU core pair.
# PyTorch's CPU attention is a fused kernel (``_scaled_dot_product_flash_attention_for_cpu``):
# it keeps no score matrix and skips the masked blocks of a causal mask.
CPU_DEFAULT = DeviceProfile(
    name="cpu", peak={"float32": 50e9, "float64": 25e9}, memory=16 * GB, memory_bw=5 * GB,
    intra_bw=1 * GB, intra_latency=100e-6, inter_bw=0.1 * GB, inter_latency=200e-6,
    per_node=1024, op_overhead=20e-6, view_overhead=5e-6, flash_attention=True, comm_overlap=0.0,
    exchange_bytes=4 << 20,  # ``ssdsl.runtime.exchange.MAX_BYTES``
    source="default (not measured: run bench/bench_cost.py)")

GPUS = {p.name: p for p in (V100, A100, H100)}


def cpu_profile(path: Path | None = None) -> DeviceProfile:
    """The measured CPU profile written by ``bench/bench_cost.py`` (or the file named by the
    environment variable ``SSDSL_CPU_PROFILE``), else the default."""
    path = Path(path or os.environ.get("SSDSL_CPU_PROFILE") or CPU_PROFILE_FILE)
    if not path.exists():
        return CPU_DEFAULT
    data = json.loads(path.read_text())
    return DeviceProfile(**{k: v for k, v in data.items()
                            if k in attrs.fields_dict(DeviceProfile)})


def profile(name: str) -> DeviceProfile:
    """The profile called ``name`` (``v100``, ``a100``, ``h100``, ``cpu``)."""
    key = name.lower()
    if key == "cpu":
        return cpu_profile()
    if key not in GPUS:
        raise UnknownDevice(f"no device profile '{name}'",
                            hint=f"choose one of {', '.join([*GPUS, 'cpu'])}")
    return GPUS[key]


def profile_names() -> tuple[str, ...]:
    return (*GPUS, "cpu")
