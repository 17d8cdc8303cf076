"""One training job on every rank: plan, materialize, train, and gather the results.

``rank_main(spec)`` is what each process runs (under ``ssdsl run --nproc N`` or under torchrun):
it traces the model file, elaborates and applies the plan, builds this rank's program, trains
``spec.steps`` steps, and returns (on rank 0) the losses and the gathered final parameters.
Every rank derives the same plan from the same inputs, so nothing but tensors crosses processes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from ssdsl.check import check_programs, check_schedule
from ssdsl.lower import lower_plan
from ssdsl.elaborate import elaborate_file
from ssdsl.materialize.program import Materialized, materialize
from ssdsl.runtime import dist as sdist
from ssdsl.runtime.executor import RankProgram, create_groups
from ssdsl.runtime.launch import report_event
from ssdsl.runtime.train import MetricsCollector, OptimizerSpec, autocast
from ssdsl.errors import SsdslError
from ssdsl.schedule.lower import Lowered
from ssdsl.schedule.resolve import resolve_pipeline
from ssdsl.trace.export import TraceError, trace
from ssdsl.trace.model_file import load_model_file
from ssdsl.transform import Transformed, transform

# The parameters' dtype per --dtype; "bfloat16" keeps float32 parameters (and optimizer state)
# and runs the forward under autocast (``ssdsl.runtime.train.autocast``).
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}


@attrs.frozen
class JobSpec:
    """Everything a rank needs to rebuild the job by itself (picklable)."""

    model: str
    plan: str
    sets: tuple[tuple[str, str], ...] = ()
    steps: int = 5
    batch_size: int | None = None
    seed: int = 0
    dtype: str = "float32"
    optimizer: str = "model"
    lr: float | None = None
    resume: str | None = None        # a checkpoint directory or a state-dict file to start from
    checkpoint: str | None = None    # a directory to write this run's sharded checkpoint into
    # a folder of files `ssdsl compile` wrote: each rank runs its rank<N>.py
    compiled: str | None = None
    # the seeded model's state written by the launching process (``ssdsl.runtime.init``);
    # None: the ranks make it themselves (under torchrun)
    init_file: str | None = None
    # the launching process's traced graph, pickled (``launch_files``): the ranks plan from the
    # very graph whose programs the launcher checked, and never trace or build the model
    graph_file: str | None = None
    # a gate file (``ssdsl.runtime.gate``): the ranks wait there before their first step while
    # the launcher verifies the job
    gate_file: str | None = None
    # ``Materialized.send_first``: decided for the ranks' hosts once (``for_host``) before the
    # job is planned, so that the checked programs and the ranks' are the same; None: not yet
    # decided (plans as True)
    send_first: bool | None = None


def for_host(spec: JobSpec, *, local: int | None = None, threads: int | None = None,
             device: str = "cpu") -> JobSpec:
    """``spec`` with ``send_first`` decided where it is not: True on GPUs, and on CPUs where
    ``local`` ranks of ``threads`` compute threads (this host's, ``ssdsl.runtime.host``) each
    have a core of their own; False where they share cores (the last backward's second walk
    would take a core another rank needs: measured on the peers' 1f1b, 4 ranks on 2 cores,
    it made the step 1.02-1.03 times as long). A job of compiled files keeps the programs
    they were written with."""
    from ssdsl.runtime.host import own_cores
    if spec.send_first is not None or spec.compiled is not None:
        return spec
    return attrs.evolve(spec, send_first=device != "cpu" or own_cores(local, threads))


def agreed_for_host(spec: JobSpec, ctx: sdist.DistContext) -> JobSpec:
    """``for_host`` on every rank of a running job, the ranks agreeing (hosts may differ):
    ``send_first`` only where every rank's host allows it."""
    if spec.send_first is not None or spec.compiled is not None:
        return spec
    mine = for_host(spec, device=ctx.device.type).send_first
    return attrs.evolve(spec, send_first=all(sdist.all_gather_objects(mine)))


def plan_job(spec: JobSpec, world: int, *, model_file: Any = None
             ) -> tuple[Any, Materialized, torch.nn.Module]:
    """Model file, materialized plan and the seeded full model (CPU), as every rank builds them.
    ``model_file``: an already loaded ``ModelFile`` (the API's module), else ``spec.model``'s.

    With ``spec.compiled`` the graph is traced on the meta device, as ``ssdsl compile`` traces
    it, so that the plan is the one the files were written from."""
    mf = model_file if model_file is not None else load_model_file(spec.model)
    dtype = DTYPES[spec.dtype]
    model = mf.build(seed=spec.seed).to(dtype=dtype)
    if spec.compiled is not None:
        _check_compiled(spec.compiled, world)
        graph = compiled_graph(mf, dtype, spec.batch_size, model=model)
    else:
        graph = trace(mf, device="cpu", batch_size=spec.batch_size, model=model)
    m = plan_from_graph(spec, world, graph)
    return mf, m, model


def compiled_graph(mf: Any, dtype: torch.dtype, batch_size: int | None = None, *,
                   model: torch.nn.Module | None = None) -> Any:
    """The graph ``ssdsl compile`` writes the files from, and ``run --compiled`` checks them
    against: traced on meta in the run's ``dtype`` (a ``.to(x.dtype)`` in the forward is then
    the run's dtype, not float32), its creation operators' meta devices set to the CPU (a
    ``.to(x.device)`` would make meta tensors), and its lifted tensor constants (a module-level
    class-weight tensor) given their values from a trace of the real ``model`` (built when
    none is given)."""
    from ssdsl.runtime.init import has_tensor_constants, on_device
    with torch.device("meta"):
        meta_model = mf.build(seed=0).to(dtype=dtype)
    graph = on_device(trace(mf, device="meta", batch_size=batch_size, model=meta_model), "cpu")
    if has_tensor_constants(graph):
        if model is None:
            model = mf.build(seed=0).to(dtype=dtype)
        real = trace(mf, device="cpu", batch_size=batch_size, model=model)
        graph = attrs.evolve(graph, constants={
            k: real.constants.get(k, v) if isinstance(v, torch.Tensor) else v
            for k, v in graph.constants.items()})
    return graph


# the phase a rank reports when it stands at the gate (``ssdsl.runtime.gate``)
GATE_PHASE = "waiting for the verification before launch"

_META_TRACES = 2  # tries of the trace on meta before a rank plans from the real model


def plan_for_ranks(spec: JobSpec, world: int) -> tuple[Any, Materialized, bool]:
    """Model file and materialized plan as a rank makes them: traced on ``meta`` (the model's
    tensors are never built), creation operators moved back to the CPU. The flag is False when
    the trace lifted tensor constants: then the plan comes from a real trace, and the caller
    must initialise from the real model (``plan_job``)."""
    from ssdsl.runtime.init import has_tensor_constants, on_device
    mf = load_model_file(spec.model)
    dtype = DTYPES[spec.dtype]
    with torch.device("meta"):
        model = mf.build(seed=spec.seed).to(dtype=dtype)
    graph = None
    for _attempt in range(_META_TRACES):
        try:
            graph = trace(mf, device="meta", batch_size=spec.batch_size, model=model)
            break
        except TraceError:
            # torch.export tripped now and then on a constant it lifted ("fake tensor in
            # exported program constant's list"): the rank's heartbeat held a frame of the
            # trace across its sleep (fixed in ``launch._start_heartbeat``). Kept as a guard:
            # trace again, then plan from a real trace, where a real fault recurs
            continue
    if graph is None:
        return (*plan_job(spec, world)[:2], False)
    if has_tensor_constants(graph):
        return (*plan_job(spec, world)[:2], False)
    return mf, plan_from_graph(spec, world, on_device(graph, "cpu")), True


def plan_from_graph(spec: JobSpec, world: int, graph: Any, *, check: bool = True
                    ) -> Materialized:
    """Elaborate, transform, schedule and materialize ``spec``'s plan on a traced ``graph``;
    with ``check``, lower every rank's program and check them (what every rank will run,
    before it runs). A rank given the launcher's checked graph plans with ``check=False``."""
    plan = elaborate_file(spec.plan, world=world, sets=dict(spec.sets))
    t, lowered = schedule_plan(graph, plan)
    m = materialize(t, dtype=DTYPES[spec.dtype], schedule=lowered,
                    send_first=spec.send_first is not False)
    if check:
        check_programs(lower_plan(m).programs, m=m)
    return m


@attrs.frozen(eq=False)
class Launch:
    """What the launching process planned once (``launch_files``): ``spec`` with the files the
    ranks start from, and the checked plan (``m``) the ranks will rebuild from ``graph``."""

    spec: JobSpec
    graph: Any
    m: Materialized


@contextlib.contextmanager
def launch_files(spec: JobSpec, world: int) -> Iterator[Launch]:
    """The job planned once by the launching process, with the files the ranks start from,
    written into a temporary folder removed on exit: the seeded model's state
    (``ssdsl.runtime.init``; each rank reads only its regions) and the traced graph, whose every
    rank's program is lowered and checked here, once. The ranks plan from that graph
    (deterministically: the same graph and plan give the same programs), so what was checked is
    what runs, and no rank traces or builds the model."""
    from ssdsl.runtime.init import write_state
    mf = load_model_file(spec.model)
    model = mf.build(seed=spec.seed)
    with tempfile.TemporaryDirectory(prefix="ssdsl-launch-") as tmp:
        state = write_state(model, Path(tmp) / "initial_state.pt")
        graph = trace(mf, device="cpu", batch_size=spec.batch_size,
                      model=model.to(dtype=DTYPES[spec.dtype]))
        del model
        m = plan_from_graph(spec, world, graph)
        graph_path = Path(tmp) / "graph.pickle"
        with open(graph_path, "wb") as f:
            pickle.dump(graph, f, protocol=pickle.HIGHEST_PROTOCOL)
        yield Launch(attrs.evolve(spec, init_file=str(state), graph_file=str(graph_path)),
                     graph, m)


def _graph_of(spec: JobSpec) -> Any:
    with open(spec.graph_file, "rb") as f:
        return pickle.load(f)


def schedule_plan(graph: Any, plan: Any) -> tuple[Transformed, Lowered | None]:
    """Transform, place stages, split micro-batches, lower and CHECK the schedule (phases 4-6)."""
    t, lowered = resolve_pipeline(transform(graph, plan))
    if lowered is not None:
        check_schedule(lowered.schedule)
        _refuse_split_recompute(t, lowered)
    return t, lowered


class CompiledFilesMissing(SsdslError):
    """``--compiled DIR`` lacks the file of a rank."""


def _check_compiled(folder: str, world: int) -> None:
    missing = [f"rank{r}.py" for r in range(world) if not (Path(folder) / f"rank{r}.py").is_file()]
    if missing:
        raise CompiledFilesMissing(f"--compiled {folder}: no {', '.join(missing[:3])}",
                                   hint=f"compile with `ssdsl compile MODEL PLAN --world {world} "
                                   f"-o {folder}`")


def _rank_program(spec: JobSpec, m: Materialized, rank: int, mf: Any, model: torch.nn.Module,
                  groups: Any) -> RankProgram:
    """The interpreter of this rank's program, or its compiled file (``spec.compiled``)."""
    kwargs = dict(dtype=DTYPES[spec.dtype], optimizer=OptimizerSpec(spec.optimizer, spec.lr),
                  groups=groups)
    if spec.compiled is None:
        return RankProgram(m, rank, mf, model, **kwargs)
    from ssdsl.runtime.compiled import GeneratedRankProgram, load_program_file
    module = load_program_file(Path(spec.compiled) / f"rank{rank}.py")
    return GeneratedRankProgram(m, rank, mf, model, module=module, **kwargs)


class SplitBackwardWithRecompute(SsdslError):
    """A schedule with input-grad / weight-grad units and ``recompute``: the two halves of a
    split backward would each run the recomputed region again, which the runtime does not do."""


def _refuse_split_recompute(t: Transformed, lowered: Lowered) -> None:
    if lowered.schedule.split_backward and t.recompute:
        op, span = next(iter(t.recompute.items()))
        raise SplitBackwardWithRecompute(
            f"'{op}' is recomputed in a schedule that splits backwards into input and weight "
            "gradients; the runtime does not recompute inside a split backward", span,
            hint="drop `recompute`, or order whole backward passes (`backward st[s] mb k`)")


def rank_main(spec: JobSpec) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns losses, final parameters and per-rank metrics."""
    from ssdsl.runtime import checkpoint as ckpt
    from ssdsl.runtime.progress import Phase
    from ssdsl.runtime.train import tokens_in

    with sdist.distributed() as ctx:
        report_event(Phase("planning"))
        spec = agreed_for_host(spec, ctx)  # the launcher decided it already, as did torchrun's
        mf, m, source = plan_with_state(spec, ctx)
        report_event(Phase("building this rank's shards"))
        groups = create_groups(m)
        prog = _rank_program(spec, m, ctx.rank, mf, source, groups)
        state_keys = ckpt.state_keys_of(mf, seed=spec.seed)
        # what no operator reads, kept by rank 0 for the saved state (``untraced_state``)
        untraced = ckpt.untraced_state(source, prog.graph, state_keys, DTYPES[spec.dtype]) \
            if ctx.rank == 0 else {}
        del source  # this rank keeps only its shards
        start = ckpt.resume_program(prog, spec.resume) if spec.resume else 0
        bs = spec.batch_size or mf.batch_size
        metrics = MetricsCollector(rank=ctx.rank, samples_per_step=bs, device=ctx.device,
                                   tokens_per_step=tokens_in(mf.get_batch(start, bs)[0]))
        comm = m.accounting()["total_bytes"]
        if spec.gate_file is not None:
            from ssdsl.runtime.gate import Gate
            report_event(Phase(GATE_PHASE))
            Gate(spec.gate_file).wait()
        report_event(Phase("training"))
        losses = []
        for step in range(start, spec.steps):
            metrics.begin()
            with autocast(spec.dtype, ctx.device):
                loss = prog.step(step, spec.batch_size)
            report_event(metrics.end(step, loss=loss, comm_bytes=comm))
            losses.append(loss)
        if spec.checkpoint:
            report_event(Phase("saving the checkpoint"))
            ckpt.save_program(prog, spec.checkpoint, step=spec.steps, state_keys=state_keys,
                              model=spec.model, plan=spec.plan, untraced=untraced)
        shards = sdist.gather_objects(ckpt.program_shards(prog))
        summaries = sdist.gather_objects(metrics.summary())
        if ctx.rank != 0:
            return None
        return {"losses": losses, "first_step": start,
                "params": ckpt.model_state((s for r in shards for s in r[0]),
                                           (s for r in shards for s in r[1]),
                                           aliases=prog.graph.aliases, state_keys=state_keys,
                                           untraced=untraced),
                "ranks": summaries, "accounting": m.accounting()}


def plan_with_state(spec: JobSpec, ctx: sdist.DistContext) -> tuple[Any, Materialized, Any]:
    """This rank's plan and where its initial shards come from, without building the model:
    the launcher's state file, else one written by local rank 0 (``ssdsl.runtime.init``)."""
    import torch.distributed as dist
    from ssdsl.runtime.init import StateFile, shared_state_file
    if spec.compiled is not None:  # the files were written from their own plan: as before
        mf, m, model = plan_job(spec, ctx.world_size)
        return mf, m, model
    if spec.graph_file is not None and spec.init_file is not None:  # ``launch_files``
        m = plan_from_graph(spec, ctx.world_size, _graph_of(spec), check=False)
        return load_model_file(spec.model), m, StateFile(spec.init_file)
    mf, m, planned_on_meta = plan_for_ranks(spec, ctx.world_size)
    # Every rank takes the same path: torch.export on meta now and then trips on a constant it
    # lifted on one rank and not on another (seen under load), and a rank that planned from a
    # real trace while its peers wait for the shared state file would never meet them.
    if not all(sdist.all_gather_objects(planned_on_meta)):
        # tensor constants, or a meta trace that failed somewhere: the real model is needed
        _, m, model = plan_job(spec, ctx.world_size)
        return mf, m, model
    if spec.init_file is not None:
        return mf, m, StateFile(spec.init_file)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    key = os.environ.get("TORCHELASTIC_RUN_ID", "") + os.environ.get("MASTER_PORT", "")
    return mf, m, shared_state_file(mf, seed=spec.seed, local_rank=local,
                                    barrier=dist.barrier, key=key)
