"""The Python API: the same pipeline as ``ssdsl run``, for people who train from their own script.

Run your script on every rank (``torchrun --nproc-per-node N train.py``, or any launcher that sets
the env:// variables); each process calls ``parallelize`` once and then trains::

    import ssdsl

    pm = ssdsl.parallelize("model.py", "megatron_tp", sets={"tp": "2"})
    for step in range(100):
        inputs, target = my_batches(step)          # the GLOBAL batch, the same on every rank
        loss = pm.train_step(inputs, target)       # forward, backward, reduce, optimizer step
    state = pm.full_state_dict()                    # merged single-device state dict (collective)

``train_step`` takes the whole batch on every rank; each rank keeps only the rows and regions its
parts need. The optimizer is the model file's (or ``optimizer="sgd"|"adamw"``) over this rank's
parameter shards (``pm.parameters()``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ssdsl.materialize.program import Materialized
from ssdsl.runtime import dist as sdist
from ssdsl.runtime.executor import RankProgram, assemble, create_groups
from ssdsl.runtime.job import DTYPES, JobSpec, plan_with_state
from ssdsl.runtime.preflight import Verification, verify_before_launch
from ssdsl.runtime.train import OptimizerSpec


class ParallelModel:
    """This rank's share of a model trained under a plan (made by ``parallelize``)."""

    def __init__(self, program: RankProgram, materialized: Materialized, ctx: sdist.DistContext):
        self._program = program
        self.plan = materialized
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        # what verification before training found (set by ``parallelize``)
        self.verification: Verification | None = None

    def train_step(self, inputs: torch.Tensor | tuple[torch.Tensor, ...],
                   target: torch.Tensor) -> float:
        """One step on the global batch; returns its loss (the same on every rank)."""
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        return self._program.train_batch((*inputs, target))

    def parameters(self) -> list[torch.Tensor]:
        """This rank's parameter shards (what its optimizer updates)."""
        return list(self._program.state.leaves.values())

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._program.opt

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter merged into one single-device tensor, on every rank (collective:
        every rank must call it)."""
        shards = sdist.all_gather_objects(self._program.shards())
        return assemble([s for rank in shards for s in rank])

    def communication(self) -> dict:
        """Collectives and bytes per training step (``Materialized.accounting``)."""
        return self.plan.accounting()


def parallelize(model_file: str, plan: str, *, sets: Mapping[str, str] | None = None,
                seed: int = 0, dtype: str = "float32", optimizer: str = "model",
                lr: float | None = None, batch_size: int | None = None,
                verify: bool = True) -> ParallelModel:
    """Plan ``model_file`` with ``plan`` (a ``.ssp`` path or stdlib name) for this job's ranks.

    Joins the process group from the environment when it is not initialized yet. Every rank
    must call it with the same arguments. ``batch_size`` is the global batch the graph is traced
    with (default: the model file's ``BATCH_SIZE``); ``train_step`` must be given batches of it.

    Before anything trains, one step of all ranks is simulated in this process against the plain
    model (``verify=False`` skips it); a difference raises ``TrainsDifferently`` on every rank,
    and a plan that could not be verified says so in a warning (``pm.verification`` tells).
    """
    if dtype not in DTYPES:
        from ssdsl.errors import UsageError
        raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    ctx = sdist.init_from_env()
    spec = JobSpec(model_file, plan, tuple((sets or {}).items()), batch_size=batch_size,
                   seed=seed, dtype=dtype, optimizer=optimizer, lr=lr)
    verification = verify_before_launch(spec, ctx.world_size, enabled=verify)
    if not verification.verified and ctx.rank == 0:
        import warnings
        warnings.warn(f"ssdsl: {verification.line()}", stacklevel=2)
    mf, m, source = plan_with_state(spec, ctx)  # this rank's shards only, never the model
    program = RankProgram(m, ctx.rank, mf, source, dtype=DTYPES[dtype],
                          optimizer=OptimizerSpec(optimizer, lr), groups=create_groups(m))
    pm = ParallelModel(program, m, ctx)
    pm.verification = verification
    return pm
