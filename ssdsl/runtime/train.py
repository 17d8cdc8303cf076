"""The plan-independent pieces of a training loop: optimizer, per-step metrics, live view, JSON result.

A rank's loop, whatever the plan, looks like::

    opt = build_optimizer(spec, model_file, local_params)   # same hyperparameters as the reference
    metrics = MetricsCollector(rank=ctx.rank, samples_per_step=batch_size, device=ctx.device)
    for step in range(steps):
        metrics.begin()
        ...                                                 # the plan's forward/backward/comm
        report_event(metrics.end(step, loss=loss_value, comm_bytes=bytes_this_step))
    return metrics.summary()

and the launcher shows the events with ``ssdsl.runtime.progress`` (or collects them for ``--json``).
"""

from __future__ import annotations

import inspect
import json
import resource
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from ssdsl.errors import SsdslError
# defined beside the progress display, which loads no torch (the first line of `ssdsl run`
# is shown before torch is imported); re-exported here, where the loop makes them
from ssdsl.runtime.progress import StepMetrics, human_bytes  # noqa: F401
from ssdsl.trace.model_file import ModelFile

OPTIMIZER_KINDS = ("model", "sgd", "adamw")
_DEFAULT_LR = 0.01


class UnknownOptimizer(SsdslError):
    """``--optimizer`` names something other than model, sgd or adamw."""


@attrs.frozen
class OptimizerSpec:
    """Which optimizer both sides of a run use.

    ``kind``: ``"model"`` (the model file's ``make_optimizer``, SGD(lr=0.01) when it has none),
    ``"sgd"`` (plain SGD: no momentum, no weight decay), or ``"adamw"`` (torch defaults).
    ``lr``: with ``"model"``, the rate of every parameter group of the model file's optimizer
    (``None``: as it makes them); for sgd/adamw, ``None`` takes the learning rate of the model
    file's optimizer, so that
    ``--optimizer sgd`` checks the same model with the same step size; for adamw only when that
    optimizer is of Adam's kind (its step is in parameter units, SGD's in gradient units: an SGD
    rate of 0.3 would move every weight by about 0.3 a step), else AdamW's own default.
    """

    kind: str = "model"
    lr: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in OPTIMIZER_KINDS:
            raise UnknownOptimizer(f"unknown optimizer {self.kind!r}",
                                   hint=f"choose one of {', '.join(OPTIMIZER_KINDS)}")


def build_optimizer(spec: OptimizerSpec, model_file: ModelFile,
                    params: Iterable[torch.nn.Parameter],
                    substitute: dict[int, list[torch.nn.Parameter]] | None = None
                    ) -> torch.optim.Optimizer:
    """The optimizer of ``spec`` over ``params`` (all parameters, or one rank's local shards).

    Element-wise optimizers (SGD, Adam, AdamW) give on a shard exactly the slice of the update on
    the whole tensor; an optimizer that looks across elements (a global gradient norm, LAMB's
    trust ratio) would not, and a plan that shards it would need a reduction this does not add.
    """
    params = list(params)
    if not params:  # a rank whose operators read no parameter (a pipeline stage of the loss
        # alone): one empty tensor, which every torch optimizer takes and whose step is nothing
        params = [torch.nn.Parameter(torch.zeros(0))]
    if spec.kind == "model":
        opt = model_file.make_optimizer(params)
        if spec.lr is not None:  # ``--lr`` with the model's own optimizer: every group's rate
            for group in opt.param_groups:
                if isinstance(group.get("lr"), torch.Tensor):
                    group["lr"].fill_(spec.lr)
                else:
                    group["lr"] = spec.lr
    else:
        cls = torch.optim.SGD if spec.kind == "sgd" else torch.optim.AdamW
        lr = spec.lr if spec.lr is not None else model_lr(model_file, cls)
        opt = cls(params, lr=lr)
    if substitute:  # ZeRO: each weight of a sharded bucket stepped as its pieces of the chunk,
        # in the group the optimizer put the weight in (nothing has been stepped yet)
        for group in opt.param_groups:
            group["params"] = [q for p in group["params"]
                               for q in substitute.get(id(p), [p])]
    return opt


# Optimizers whose step divides by a running gradient scale: their learning rate is a step in
# parameter units, and carries over between them.
_ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
             torch.optim.Adamax)


def model_lr(model_file: ModelFile, for_optimizer: type | None = None) -> float:
    """The learning rate of the model file's optimizer (its first parameter group); for an
    adaptive ``for_optimizer`` (AdamW) only when the model's optimizer is adaptive too, else
    ``for_optimizer``'s own default."""
    probe = model_file.make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    if for_optimizer is not None and issubclass(for_optimizer, _ADAPTIVE) \
            and not isinstance(probe, _ADAPTIVE):
        return float(inspect.signature(for_optimizer).parameters["lr"].default)
    lr = probe.param_groups[0].get("lr", _DEFAULT_LR)
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def autocast(dtype: str, device: torch.device | str = "cpu") -> Any:
    """The context a training step runs in for ``--dtype``: ``torch.autocast`` to bfloat16 for
    ``"bfloat16"`` (float32 parameters, bfloat16 matmuls), else nothing."""
    import contextlib
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    kind = torch.device(device).type
    # No weight cache: it keeps the bfloat16 copy of a parameter for as long as the context is
    # open, so a context around several steps would reuse copies of the weights of step 0.
    return torch.autocast(kind, dtype=torch.bfloat16, cache_enabled=False)


# ----------------------------------------------------------------------------- metrics


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak on a GPU, the process's max RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


@attrs.frozen
class RankSummary:
    """One rank's run: medians over the steps after warm-up, totals over all steps."""

    rank: int
    steps: int
    median_step_s: float
    samples_per_s: float
    comm_bytes_per_step: float
    peak_memory_bytes: int


class MetricsCollector:
    """Times the steps of one rank and reads its peak memory."""

    def __init__(self, *, rank: int, samples_per_step: int, device: torch.device,
                 tokens_per_step: int | None = None) -> None:
        self.rank = rank
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.device = device
        self.history: list[StepMetrics] = []
        self._start: float | None = None

    def begin(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def end(self, step: int, *, loss: float | None, comm_bytes: int = 0) -> StepMetrics:
        if self._start is None:
            raise RuntimeError("MetricsCollector.end() without begin()")
        self._sync()  # GPU work is asynchronous: time it, not its launch
        seconds = time.perf_counter() - self._start
        self._start = None
        metrics = StepMetrics(rank=self.rank, step=step, loss=loss, step_s=seconds,
                              samples_per_s=self.samples_per_step / seconds if seconds else 0.0,
                              comm_bytes=int(comm_bytes),
                              peak_memory_bytes=peak_memory_bytes(self.device),
                              tokens_per_s=(self.tokens_per_step / seconds
                                            if self.tokens_per_step and seconds else None))
        self.history.append(metrics)
        return metrics

    def summary(self, *, warmup: int = 1) -> RankSummary:
        return summarize(self.history, rank=self.rank, warmup=warmup)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def summarize(history: Sequence[StepMetrics], *, rank: int, warmup: int = 1) -> RankSummary:
    """Median step time after ``warmup`` steps (first steps pay for allocation and lazy init)."""
    timed = list(history[warmup:]) or list(history)
    if not timed:
        return RankSummary(rank, 0, 0.0, 0.0, 0.0, peak_memory_bytes(torch.device("cpu")))
    median = statistics.median(m.step_s for m in timed)
    # the batch over the median time, as every step's rate is the batch over its time (a median
    # of the rates would not be the rate of the median step)
    per_step = timed[0].samples_per_s * timed[0].step_s
    samples = per_step / median if median else 0.0
    return RankSummary(rank=rank, steps=len(history), median_step_s=median, samples_per_s=samples,
                       comm_bytes_per_step=statistics.fmean(m.comm_bytes for m in history),
                       peak_memory_bytes=max(m.peak_memory_bytes for m in history))


def tokens_in(inputs: Sequence[torch.Tensor]) -> int | None:
    """Tokens in a batch whose first input holds token ids (an integer tensor of batch x seq
    or more dims), else None: samples/s is then the only rate shown."""
    first = inputs[0] if inputs else None
    if first is None or first.is_floating_point() or first.is_complex() or first.dim() < 2:
        return None
    return int(first.numel())


# ----------------------------------------------------------------------------- showing a run


@attrs.frozen
class RunResult:
    """What ``ssdsl run --json`` prints: the run's settings, the loss per step, each rank's summary
    and, with ``--check``, the verdict (``Verdict.as_dict()`` from ``ssdsl.runtime.reference``)."""

    model: str
    plan: str
    nproc: int
    steps: int
    batch_size: int
    seed: int
    dtype: str
    optimizer: str
    losses: tuple[float, ...]
    ranks: tuple[RankSummary, ...]
    check: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=True)
        data["losses"] = list(self.losses)
        data["ranks"] = [attrs.asdict(r) for r in self.ranks]
        data["ok"] = None if self.check is None else bool(self.check.get("ok"))
        return data

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False)
