"""The Python API: the same pipeline as ``ssdsl run``, for people who train from their own script.

Run your script on every rank (``torchrun --nproc-per-node N train.py``, or any launcher that sets
the env:// variables); each process calls ``parallelize`` once and then trains::

    import ssdsl

    pm = ssdsl.parallelize("model.py", "megatron_tp", sets={"tp": "2"})
    for step in range(100):
        inputs, target = my_batches(step)          # the GLOBAL batch, the same on every rank
        loss = pm.train_step(inputs, target)       # forward, backward, reduce, optimizer step
    state = pm.full_state_dict()                    # merged single-device state dict (collective)

or with a module you built yourself and a batch function (or one example batch)::

    pm = ssdsl.parallelize(model, "dp", batch=get_batch)        # get_batch(step, batch_size)
    pm = ssdsl.parallelize(model, "dp", batch=(inputs, target))  # the shapes every batch has

``train_step`` takes the whole batch on every rank; each rank keeps only the rows and regions its
parts need. The optimizer is the model file's (or ``optimizer="sgd"|"adamw"``) over this rank's
parameter shards (``pm.parameters()``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ssdsl.errors import SsdslError, UsageError
from ssdsl.materialize.program import Materialized
from ssdsl.runtime import checkpoint as ckpt
from ssdsl.runtime import dist as sdist
from ssdsl.runtime.executor import RankProgram, create_groups
from ssdsl.runtime.job import DTYPES, JobSpec, agreed_for_host, plan_job, plan_with_state
from ssdsl.runtime.preflight import Verification, verify_before_launch
from ssdsl.runtime.train import OptimizerSpec, autocast
from ssdsl.trace.model_file import ModelFile, default_loss, default_optimizer

Batch = tuple[Any, torch.Tensor]


class BatchShapeError(SsdslError):
    """``train_step`` got a batch whose shapes differ from the batch the plan was made for."""


class ParallelModel:
    """This rank's share of a model trained under a plan (made by ``parallelize``)."""

    def __init__(self, program: RankProgram, materialized: Materialized, ctx: sdist.DistContext,
                 *, state_keys: list[str], spec: JobSpec,
                 untraced: dict[str, torch.Tensor] | None = None):
        self._program = program
        # the state entries no operator reads (``checkpoint.untraced_state``): as built
        self._untraced = untraced or {}
        self.plan = materialized
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self._device = ctx.device
        self._state_keys = state_keys
        self._spec = spec
        self.step = 0  # steps trained (continued by load_checkpoint)
        graph = materialized.transformed.graph
        self._shapes = [tuple(graph.tensors[n].shape) for n in graph.batch_inputs]
        # what verification before training found (set by ``parallelize``)
        self.verification: Verification | None = None

    def train_step(self, inputs: torch.Tensor | tuple[torch.Tensor, ...],
                   target: torch.Tensor) -> float:
        """One step on the global batch; returns its loss (the same on every rank)."""
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        batch = (*inputs, target)
        self._check_shapes(batch)
        with autocast(self._spec.dtype, self._device):
            loss = self._program.train_batch(batch)
        self.step += 1
        return loss

    def _check_shapes(self, batch: tuple[torch.Tensor, ...]) -> None:
        names = [f"input {i}" for i in range(len(batch) - 1)] + ["target"]
        if len(batch) != len(self._shapes):
            raise BatchShapeError(f"train_step got {len(batch) - 1} inputs and a target; the "
                                  f"plan was made for {len(self._shapes) - 1} inputs and a target")
        for name, t, want in zip(names, batch, self._shapes):
            if tuple(t.shape) != want:
                rows = f"batch size {t.shape[0]}" if t.dim() else "a scalar"
                raise BatchShapeError(
                    f"train_step: {name} has shape {tuple(t.shape)} ({rows}), but the plan was "
                    f"made for shape {want} (batch size {want[0] if want else '-'})",
                    hint="give every step a batch of the size parallelize traced with, or pass "
                    f"batch_size={t.shape[0] if t.dim() else '...'} to parallelize")

    def parameters(self) -> list[torch.Tensor]:
        """This rank's parameter shards (what its optimizer updates)."""
        return list(self._program.state.leaves.values())

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._program.opt

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device model's ``state_dict``, merged from every rank's shards, tied
        parameters under each of their names, so ``model.load_state_dict(state)`` is strict.
        Collective: every rank must call it; every rank gets the result."""
        shards = sdist.all_gather_objects(ckpt.program_shards(self._program))
        return ckpt.model_state((s for r in shards for s in r[0]), (s for r in shards for s in r[1]),
                                aliases=self._program.graph.aliases, state_keys=self._state_keys,
                                untraced=self._untraced)

    def save_checkpoint(self, directory: str | Path) -> None:
        """Each rank writes its shards and optimizer state to ``directory`` (collective); merge
        with ``ssdsl merge DIR -o FILE`` or ``ssdsl.runtime.checkpoint.merge_checkpoint``."""
        ckpt.save_program(self._program, directory, step=self.step, state_keys=self._state_keys,
                          model=self._spec.model, plan=self._spec.plan,
                          untraced=self._untraced if self.rank == 0 else None)

    def load_checkpoint(self, path: str | Path) -> int:
        """Load a checkpoint directory (parameters, optimizer state, step) or a state-dict file
        (parameters) into this rank's shards; returns the step to continue from."""
        self.step = ckpt.resume_program(self._program, path)
        return self.step

    def communication(self) -> dict:
        """Collectives and bytes per training step (``Materialized.accounting``)."""
        return self.plan.accounting()


def parallelize(model: str | Path | torch.nn.Module, plan: str, *,
                batch: Callable[[int, int], Batch] | Batch | None = None,
                loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                make_optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                input_dims: tuple[tuple[str, ...], ...] | None = None,
                sets: Mapping[str, str] | None = None, seed: int = 0, dtype: str = "float32",
                optimizer: str = "model", lr: float | None = None,
                batch_size: int | None = None, verify: bool = True) -> ParallelModel:
    """Plan ``model`` with ``plan`` (a ``.ssp`` path or stdlib name) for this job's ranks.

    ``model`` is a model file (path), or an ``nn.Module`` together with ``batch``: a function
    ``get_batch(step, batch_size)`` or one example ``(inputs, target)``, which gives the shapes
    the plan is made for; ``loss``, ``make_optimizer`` and ``input_dims`` play the roles of the
    model file's names. A module's parameters are taken from rank 0, so every rank starts alike.

    Joins the process group from the environment when it is not initialized yet. Every rank
    must call it with the same arguments. ``batch_size`` is the global batch the graph is traced
    with (default: the model file's ``BATCH_SIZE``, or the example's); ``train_step`` must be
    given batches of it.

    Before anything trains, one step of all ranks is simulated in this process against the plain
    model (``verify=False`` skips it; for a module, the plain model is a copy of the module as
    rank 0 passed it); a difference raises ``TrainsDifferently`` on every rank, and a plan that
    could not be verified says so in a warning (``pm.verification`` tells).
    """
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    ctx = sdist.init_from_env()
    mf = None
    if isinstance(model, torch.nn.Module):
        mf = module_model_file(model, batch=batch, loss=loss, make_optimizer=make_optimizer,
                               input_dims=input_dims)
        if batch_size is None:
            batch_size = mf.batch_size
        name = f"<{type(model).__name__}>"
    elif isinstance(model, (str, Path)):
        if batch is not None or loss is not None or make_optimizer is not None:
            raise UsageError("batch=, loss= and make_optimizer= go with an nn.Module; a model "
                             "file defines get_batch, loss and make_optimizer itself")
        name = str(model)
    else:
        raise UsageError(f"parallelize takes a model file path or an nn.Module, not "
                         f"{type(model).__name__}",
                         hint="pass the module itself, or the path of a model file")
    spec = JobSpec(name, plan, tuple((sets or {}).items()), batch_size=batch_size,
                   seed=seed, dtype=dtype, optimizer=optimizer, lr=lr)
    spec = agreed_for_host(spec, ctx)  # before anything is planned: every rank lowers alike
    if mf is None:
        verification = verify_before_launch(spec, ctx.world_size, enabled=verify)
        mf, m, source = plan_with_state(spec, ctx)  # this rank's shards only, never the model
    else:
        verification = verify_before_launch(spec, ctx.world_size, enabled=verify,
                                            model_file=mf)
        mf, m, source = plan_job(spec, ctx.world_size, model_file=mf)
    if not verification.verified and ctx.rank == 0:
        import warnings
        warnings.warn(f"ssdsl: {verification.line()}", stacklevel=2)
    program = RankProgram(m, ctx.rank, mf, source, dtype=DTYPES[dtype],
                          optimizer=OptimizerSpec(optimizer, lr), groups=create_groups(m))
    state_keys = ckpt.state_keys_of(mf, seed=seed)
    pm = ParallelModel(program, m, ctx, state_keys=state_keys, spec=spec,
                       untraced=ckpt.untraced_state(source, m.transformed.graph, state_keys,
                                                    DTYPES[dtype]))
    pm.verification = verification
    return pm


def module_model_file(module: torch.nn.Module, *, batch: Callable[[int, int], Batch] | Batch | None,
                      loss: Callable | None = None, make_optimizer: Callable | None = None,
                      input_dims: tuple[tuple[str, ...], ...] | None = None) -> ModelFile:
    """The model-file contract (``ssdsl.trace.model_file``) for a module built in the caller's
    script; its parameters are broadcast from rank 0 first."""
    if batch is None:
        raise UsageError("parallelize(module, plan) needs batch=: a function get_batch(step, "
                         "batch_size) or an example (inputs, target) with the shapes of every "
                         "batch", hint="the plan is made for the shapes of that batch")
    if callable(batch):
        get_batch, size = batch, None
    else:
        if not (isinstance(batch, tuple) and len(batch) == 2):
            raise UsageError("batch= must be get_batch(step, batch_size) or a pair "
                             "(inputs, target)")
        example = batch
        first = example[0] if isinstance(example[0], torch.Tensor) else example[0][0]
        size = int(first.shape[0])

        def get_batch(step: int, batch_size: int) -> Batch:
            return example
    _broadcast_from_rank0(module)
    snapshot = copy.deepcopy(module)
    return ModelFile(path=f"<{type(module).__name__}>",
                     build_model=lambda: copy.deepcopy(snapshot), get_batch_fn=get_batch,
                     loss=loss or default_loss, make_optimizer=make_optimizer or default_optimizer,
                     batch_size=size or 8, input_dims=input_dims,
                     has_optimizer=make_optimizer is not None)


def _broadcast_from_rank0(module: torch.nn.Module) -> None:
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in module.state_dict().values():
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                dist.broadcast(t, 0)
