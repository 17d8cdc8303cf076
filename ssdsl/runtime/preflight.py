"""Verification before launch: a plan that trains differently from one device never starts.

``verify_before_launch`` is what ``ssdsl run`` and ``ssdsl.parallelize`` call before any rank
starts (DESIGN §7). It plans the job as the ranks will, then:

1. calls ``get_batch`` twice for the same step and refuses a model file whose batches differ
   (every rank calls it and must see the same batch);
2. refuses random operators in the traced training graph (dropout with p > 0, ``rand``,
   ``bernoulli``, ...: every operator PyTorch tags ``nondeterministic_seeded``): each rank would
   draw its own numbers, and no single-device run would match;
3. simulates one training step of all ranks in one process (``simulate_step``) against the plain
   model on the same batch, in float64: the very programs the ranks will run (planned in the
   run's dtype), their floats and the dtypes their calls name run in float64. Where those do
   not agree, the job is planned again from a float64 trace (the run's dtype when the model does
   not build or trace in float64), and that plan's verdict stands. A difference
   raises ``TrainsDifferently`` naming the first operator and tensor where the forward values
   part, and the plan statement behind it (exit status 2, before any rank starts).

It says, never silently, when it did not verify: skipped by request, a model too large to
simulate in this process's memory (an estimate of the simulation's bytes against the memory
available), or a plan the simulator cannot run yet.
"""

from __future__ import annotations

import math

import os
import time
from typing import Any

import attrs
import torch

from ssdsl.errors import SsdslError
from ssdsl.ir.graph import Graph, map_tensor_refs
from ssdsl.ir.interpret import call_target, with_step_values
from ssdsl.ir.region import Region
from ssdsl.materialize.program import Materialized
from ssdsl.runtime.init import named_values
from ssdsl.runtime.job import JobSpec, plan_job
from ssdsl.runtime.reference import to_dtype
from ssdsl.trace.model_file import ModelFile, PlainModelRaised, def_span, load_model_file
# The model file's contract checks run in the trace phase (so `ssdsl check` and `--no-verify`
# report them too); verification calls them again on what it plans.
from ssdsl.trace.trial import (NonDeterministicBatch, RandomOperator,  # noqa: F401
                               check_batch_deterministic, random_operators,
                               refuse_random_operators)


class TrainsDifferently(SsdslError):
    """One simulated step of all ranks differs from the plain model."""


@attrs.frozen
class Verification:
    """What verification before launch did: ``status`` is ``verified``, ``skipped`` or
    ``not verified``; ``reason`` says why when it is not ``verified``."""

    status: str
    reason: str = ""
    seconds: float = 0.0
    dtype: str = ""
    loss: float | None = None
    reference_loss: float | None = None
    max_grad_error: float | None = None
    # under ``ssdsl run``: how long the started ranks stood waiting for this verification before
    # their first step (``ssdsl.runtime.gate``), i.e. what verifying added to the start-up
    held_ranks_s: float | None = None

    @property
    def verified(self) -> bool:
        return self.status == "verified"

    def line(self) -> str:
        """One line for the user."""
        if self.verified:
            took = f"{self.seconds:.1f} s" if self.held_ranks_s is None else \
                f"{self.seconds:.1f} s while the ranks started, which then waited " \
                f"{self.held_ranks_s:.2f} s for it"
            said = (f"verified before launch ({took}): one step of all ranks, "
                    f"simulated in {self.dtype}, matches the plain model (loss {self.loss:.6g}, "
                    f"worst gradient error {self.max_grad_error:.2g})")
            ref = self.reference_loss
            if ref is not None and not math.isfinite(ref):
                said += (f"; note the plain model's own loss is {ref} in {self.dtype}: the "
                         "plan computes the same, the model does not train in this dtype")
            return said
        return f"NOT verified against the plain model: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def verify_before_launch(spec: JobSpec, world: int, *, enabled: bool = True,
                         available_bytes: int | None = None,
                         planned: Materialized | None = None,
                         model_file: ModelFile | None = None) -> Verification:
    """Plan ``spec`` for ``world`` ranks and verify it (module doc); raises the ``SsdslError``
    that stops the launch, else says what was verified. With ``enabled=False`` the job is only
    planned (its faults still raise) and the result says verification was skipped.

    ``planned``: the job as the launcher already planned it (``ssdsl.runtime.job.launch_files``);
    it is not planned again: its own programs are the ones simulated, in float64.
    ``model_file``: the model as already loaded (``parallelize``'s module, whose plain model is
    a copy of the module itself), else ``spec.model``'s file."""
    start = time.perf_counter()
    if not enabled:
        if planned is None:
            plan_job(spec, world, model_file=model_file)
        return Verification("skipped", "skipped by request (--no-verify)")
    mf = model_file if model_file is not None else load_model_file(spec.model)
    check_batch_deterministic(mf, spec.batch_size)
    m = planned if planned is not None else plan_job(spec, world, model_file=model_file)[1]
    check_batch_shard(mf, spec.batch_size, m)
    refuse_random_operators(m.transformed.graph, mf.path)
    need, have = simulation_bytes(m, torch.float64), available_memory() \
        if available_bytes is None else available_bytes
    if need > have // 2:
        return Verification("not verified", f"the model is too large to simulate in this "
                            f"process: about {need / 2**30:.1f} GiB needed, "
                            f"{have / 2**30:.1f} GiB available", time.perf_counter() - start)
    # The programs that will run, run here in float64 (a wrong scaling cannot hide in rounding
    # there): no second plan. Only when they do not agree so (or do not run in float64) is the
    # job planned again from a float64 trace: a model can compute otherwise in float64 than its
    # float32 trace says (``torch.finfo(x.dtype).eps`` was traced as float32's), and the
    # float64 plan locates a difference best. Should that plan agree where the programs that
    # run did not, those programs are judged in their own dtype: the verdict is always theirs.
    if m.dtype != torch.float64:
        try:
            verdict = simulate_step(m, mf, seed=spec.seed, batch_size=spec.batch_size,
                                    dtype=torch.float64, optimizer=_optimizer_of(spec))
        except SimulatorCannotRun:
            verdict = None
        if verdict is not None and verdict.ok:
            return _verified(verdict, start, "float64")
        m64, dtype = _plan_for_verification(spec, world, model_file)
        verdict = _simulated(m64, mf, spec, start)
        # not simulated in float64 (the plain model has no float64 kernel for an operator, say):
        # the programs that run are still simulated in their own dtype below
        if m64.dtype == m.dtype:
            return _verified(verdict, start, dtype)
    return _verified(_simulated(m, mf, spec, start), start, str(m.dtype).removeprefix("torch."))


def _simulated(m: Materialized, mf: ModelFile, spec: JobSpec, start: float) -> Any:
    """``m``'s verdict in its own dtype, or a Verification saying why the simulator did not
    run it; raises the located difference when it trains differently."""
    try:
        verdict = simulate_step(m, mf, seed=spec.seed, batch_size=spec.batch_size,
                                optimizer=_optimizer_of(spec))
    except SimulatorCannotRun as why:
        if why.both and str(m.dtype).removeprefix("torch.") == spec.dtype:
            # the plain model fails in the dtype the ranks run in, and so did their programs
            err = why.plain
            err.message = (f"{err.message}; the ranks would fail the same way: the model does "
                           f"not train in {spec.dtype} here")
            raise err
        return Verification("not verified", str(why), time.perf_counter() - start)
    if not verdict.ok:
        raise _difference(m, mf, verdict, seed=spec.seed, batch_size=spec.batch_size)
    return verdict


def _optimizer_of(spec: JobSpec) -> Any:
    """The optimizer the job's ranks build (``--optimizer``, ``--lr``)."""
    from ssdsl.runtime.train import OptimizerSpec
    return OptimizerSpec(spec.optimizer, spec.lr)


def _verified(verdict: Any, start: float, dtype: str) -> Verification:
    if isinstance(verdict, Verification):  # not verified: said as it is
        return verdict
    return Verification("verified", "", time.perf_counter() - start, dtype, verdict.loss,
                        verdict.reference_loss, verdict.max_grad_error)


# -- 1 and 2: the model file's contract ---------------------------------------------------------


def check_batch_shard(mf: ModelFile, batch_size: int | None, m: Materialized) -> None:
    """``get_batch_shard`` (when the model file has one) returns, for the rows every rank will
    ask for, exactly those rows of ``get_batch``: ``NonDeterministicBatch`` otherwise.

    A graph with step values (a loss's count over the whole batch, ``Graph.prologue``) makes
    every rank call ``get_batch`` instead (``RankProgram.step``): there is nothing to check, and
    its programs take the step values as 0-d inputs, which ``input_rows`` cannot place."""
    if mf.get_batch_shard_fn is None or m.transformed.graph.prologue:
        return
    from ssdsl.lower import lower_plan
    from ssdsl.runtime.executor import input_rows
    inputs, target = mf.get_batch(0, batch_size)
    whole = (*inputs, target)
    asked = sorted({r for p in lower_plan(m).programs for r in [input_rows(p)] if r is not None})
    for start, stop in asked:
        got_inputs, got_target = mf.get_rows(0, batch_size, start, stop)
        got = (*got_inputs, got_target)
        if len(got) != len(whole) or any(
                a.shape != b[start:stop].shape or not torch.equal(a, b[start:stop])
                for a, b in zip(got, whole)):
            raise NonDeterministicBatch(
                f"get_batch_shard(0, batch_size, {start}, {stop}) differs from rows "
                f"{start}:{stop} of get_batch(0, batch_size): a rank would train on other data "
                "than the plain model", def_span(mf.path, mf.get_batch_shard_fn), file=mf.path,
                hint="return exactly rows start:stop of what get_batch returns for the step "
                "(or remove get_batch_shard; every rank then calls get_batch)")


# -- 3: one simulated step -----------------------------------------------------------------------


class SimulatorCannotRun(Exception):
    """The all-ranks simulator does not run this plan (not a fault of the plan); ``plain``: the
    plain model's own failure in that dtype, where that is why; ``both``: the ranks' programs
    failed in the simulation as well (else only the plain model did: an eager kernel without
    that dtype, which the traced graph does not call)."""

    def __init__(self, message: str, plain: PlainModelRaised | None = None,
                 both: bool = False) -> None:
        super().__init__(message)
        self.plain = plain
        self.both = both


def simulate_step(m: Materialized, mf: ModelFile, *, seed: int, batch_size: int | None,
                  dtype: torch.dtype | None = None, optimizer: Any = None) -> Any:
    """One training step of all ranks simulated in this process against the plain model: a
    verdict with ``ok``, ``problems``, ``loss``, ``reference_loss``, ``max_grad_error``;
    ``dtype``: run the programs in it rather than ``m.dtype``; ``optimizer`` (the job's
    ``OptimizerSpec``): every rank steps the optimizer its trainer builds, and the shards after
    it are compared with the plain model's parameters after its own step.

    The one call into the simulator (``ssdsl.runtime.verify``), so that verification covers
    whatever plans the simulator covers."""
    from ssdsl.runtime.verify import PlanVerdict, compare_with_model, simulate_plan
    try:
        sim = simulate_plan(m, mf, seed=seed, batch_size=batch_size, dtype=dtype,
                            optimizer=optimizer)
        problems, ref_loss, worst = compare_with_model(m, mf, sim, seed=seed,
                                                       batch_size=batch_size, dtype=dtype,
                                                       optimizer=optimizer)
    except ValueError as exc:  # the simulator's refusal of plans it does not run
        raise SimulatorCannotRun(f"the all-ranks simulator cannot run this plan yet ({exc})") \
            from exc
    except PlainModelRaised as err:  # no reference in this dtype: not the simulator's fault
        raise SimulatorCannotRun(f"{err.message}{f' at {err.span}' if err.span else ''}",
                                 err) from err
    except SsdslError:
        raise
    except Exception as exc:  # noqa: BLE001 - a fault of the simulator: said, not hidden
        # unless the plain model fails the same way in this dtype (the simulation runs first)
        plain = _plain_model_fault(mf, seed=seed, batch_size=batch_size,
                                   dtype=m.dtype if dtype is None else dtype)
        if plain is not None:
            raise SimulatorCannotRun(f"{plain.message}{f' at {plain.span}' if plain.span else ''}",
                                     plain, both=True) from exc
        raise SimulatorCannotRun(f"the all-ranks simulator failed on this plan "
                                 f"({type(exc).__name__}: {exc}); please report it") from exc
    return PlanVerdict(tuple(problems), len(m.edges), (), sim.loss, ref_loss, worst)


def _plain_model_fault(mf: ModelFile, *, seed: int, batch_size: int | None,
                       dtype: torch.dtype) -> PlainModelRaised | None:
    """What the plain model raises in one training step in ``dtype``, or None when it runs."""
    from ssdsl.runtime.reference import run_reference
    from ssdsl.runtime.train import OptimizerSpec
    try:
        run_reference(mf, steps=1, seed=seed, dtype=dtype, batch_size=batch_size,
                      optimizer=OptimizerSpec("sgd"))
    except PlainModelRaised as err:
        return err
    except Exception:  # noqa: BLE001 - not the plain model's own failure: the caller says what
        return None
    return None


def _plan_for_verification(spec: JobSpec, world: int, model_file: ModelFile | None = None
                           ) -> tuple[Materialized, str]:
    """The job planned in float64 (a wrong scaling cannot hide in rounding there), or in the
    run's dtype when the model does not build or trace in float64."""
    if spec.dtype != "float64":
        try:
            _, m, _ = plan_job(attrs.evolve(spec, dtype="float64"), world, model_file=model_file)
            return m, "float64"
        except Exception:  # noqa: BLE001 - a model that traces in its own dtype only (float
            pass           # inputs from get_batch into float64 weights); a real fault recurs below
    _, m, _ = plan_job(spec, world, model_file=model_file)
    return m, spec.dtype


def simulation_bytes(m: Materialized, dtype: torch.dtype | None = None) -> int:
    """Estimated bytes the simulation holds at its peak: every rank's parameter shards with
    their gradients, every part's outputs (activations) with their gradients, and three copies
    of the full parameters (the seeded model, the reference and its gradients), in ``dtype``
    (default: the plan's)."""
    t = m.transformed
    item = torch.empty((), dtype=m.dtype if dtype is None else dtype).element_size()
    g = t.graph
    full = sum(g.tensors[p].numel for p in g.params if p in g.tensors)
    shards = sum(use.region.numel() for key, use in m.sources.items() if key[0] in g.params)
    acts = 0
    for op in g.ops:
        for part in t.parts[op.name]:
            for x, intervals in zip(op.outputs, part.sub.outputs):
                if intervals is not None and x in g.tensors:
                    acts += Region(t.shape(x), tuple(intervals)).numel()
    reference = sum(g.tensors[x].numel for op in g.ops for x in op.outputs if x in g.tensors)
    return item * (2 * shards + 2 * acts + 3 * full + 2 * reference)


def available_memory() -> int:
    """Bytes this process may still allocate (``MemAvailable``; shared by the local ranks when
    each of them verifies, as under torchrun)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    return have // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except OSError:
        pass
    return 1 << 62  # unknown: try, the simulation fails loudly if memory runs out


# -- where the values part -----------------------------------------------------------------------


def _difference(m: Materialized, mf: ModelFile, verdict: Any, *, seed: int,
                batch_size: int | None) -> TrainsDifferently:
    where = first_divergence(m, mf, seed=seed, batch_size=batch_size)
    problems = "\n  ".join(verdict.problems[:8])
    if where is not None:
        text, span = where
        return TrainsDifferently(
            f"one simulated training step differs from the plain model; {text}:\n  {problems}",
            span, hint="the plan (or ssdsl) computes something else than the model here; "
            "--no-verify would start it anyway")
    span = _param_span(m, verdict.problems)
    why = "the forward values agree; the gradients part"
    if all("after the optimizer's step" in p for p in verdict.problems):
        why = "the forward values and the gradients agree; the optimizer's steps part"
        # a ZeRO bucket's optimizer steps chunks: its statement first
        span = next((b.span for b in m.reducer.buckets if b.zero and b.span is not None),
                    span)
    return TrainsDifferently(
        f"one simulated training step differs from the plain model ({why}):\n  {problems}", span,
        hint="the plan (or ssdsl) computes something else than the model here; --no-verify "
        "would start it anyway")


def first_divergence(m: Materialized, mf: ModelFile, *, seed: int, batch_size: int | None
                     ) -> tuple[str, Any] | None:
    """The first operator (graph order, then micro-batch) whose output on some rank differs
    from the plain model's values of its region, with the plan statement behind that call; None
    when every forward value agrees.

    It reads the values of the simulated step itself: every rank's lowered program walked by a
    ``SimRunner`` that records each call's outputs (the walk that verification and the ranks
    make), so pipelines, micro-batches and recompute are located like any plan. A partial sum
    (a part holding a share of a reduced value) is compared through the sum of its value parts:
    a wrong share is blamed on the operator that computed it, a wrong adapter on its consumer."""
    from ssdsl.lower import lower_plan, run_all, walk
    from ssdsl.lower.walk import Exchange
    from ssdsl.runtime.comm import combine
    from ssdsl.runtime.executor import init_state
    from ssdsl.runtime.simulate import SimRunner
    from ssdsl.runtime.zero import zero_shards

    t, g = m.transformed, m.transformed.graph
    model = mf.build(seed=seed).to(m.dtype)
    inputs, target = mf.get_batch(0, batch_size)
    batch = with_step_values(g, to_dtype((*inputs, target), m.dtype))
    ref = _plain_values(g, model, batch)
    records: list[tuple[int, int, Any, tuple[torch.Tensor, ...]]] = []
    order = {op.name: i for i, op in enumerate(g.ops)}

    class Recorder(SimRunner):
        mb = 0

        def on_begin(self, ins) -> None:
            super().on_begin(ins)
            tail = ins.unit.rsplit("F", 1)
            self.mb = int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else 0

        def on_call(self, ins) -> None:
            super().on_call(ins)
            if ins.op in order:
                records.append((order[ins.op], self.mb, ins,
                                tuple(self.env[o].detach() for o in ins.outs)))

    exchange = Exchange(combine)
    programs = lower_plan(m).programs
    runners = {}
    for p in programs:
        state = init_state(m, p.rank, model)
        runners[p.rank] = Recorder(p.rank, state, dtype=m.dtype, exchange=exchange,
                                   zero=zero_shards(p, state.leaves))
        runners[p.rank].start(batch)
        runners[p.rank].prepare(p)
    run_all({p.rank: walk(p, runners[p.rank]) for p in programs}, exchange)
    tol = 1e-9 if m.dtype == torch.float64 else 1e-4
    sums = _value_part_sums(t, g, records)
    for _, mb, ins, outs in sorted(records, key=lambda r: (r[0], r[1])):
        op = g.op(ins.op)
        part = _part_of(t, op.name, ins)
        if part is None:
            continue
        partial = part.value_part(t.label_sizes(op.name))[1] != 1
        for i, (x, got, intervals) in enumerate(zip(op.outputs, outs, part.sub.outputs)):
            if intervals is None or not got.is_floating_point() or x not in ref:
                continue
            if partial:  # a share of a reduced value: its parts' sum is what must agree
                got = sums.get((op.name, mb, i, repr(intervals)))
                if got is None:
                    continue
            want = _global_slice(t, x, mb, intervals, ref[x])
            scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
            if got.shape != want.shape or float((got - want).abs().max()) > tol * scale:
                mb_text = f", micro-batch {mb}" if t.microbatches > 1 else ""
                what = "the sum of its partial parts" if partial else f"part {part.index}"
                return (f"the values first part at operator '{op.name}' ({op.kind}, in "
                        f"'{op.module or '<top>'}'), tensor '{x}', {what} on device "
                        f"{part.device}{mb_text}", ins.span or part.span or part.assigned_at)
    return None


def _part_of(t: Any, op: str, ins: Any) -> Any:
    """The part of ``op`` that the call instruction ``ins`` runs (None: not a part of it)."""
    return next((p for p in t.parts[op] if tuple(p.index) == tuple(ins.part)), None)


def _value_part_sums(t: Any, g: Graph, records) -> dict[tuple, torch.Tensor]:
    """For every output region of an operator split into value parts (partial sums), the sum
    of its parts' recorded values, keyed by (operator, micro-batch, output, region); a region
    whose parts were not all recorded (replicas of a part count once) is left out."""
    groups: dict[tuple, dict[int, torch.Tensor]] = {}
    wanted: dict[tuple, int] = {}
    for _, mb, ins, outs in records:
        op = g.op(ins.op)
        part = _part_of(t, op.name, ins)
        if part is None:
            continue
        k, v = part.value_part(t.label_sizes(op.name))
        if v == 1:
            continue
        for i, (got, intervals) in enumerate(zip(outs, part.sub.outputs)):
            if intervals is None or not got.is_floating_point():
                continue
            key = (op.name, mb, i, repr(intervals))
            groups.setdefault(key, {}).setdefault(k, got)
            wanted[key] = v
    return {key: sum(parts.values()) for key, parts in groups.items()
            if len(parts) == wanted[key]}


def _plain_values(g: Graph, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]
                  ) -> dict[str, torch.Tensor]:
    """Every tensor of the plain model's forward on the whole batch (the oracle)."""
    ref: dict[str, torch.Tensor] = dict(zip(g.inputs, batch))
    ref.update((k, v.detach()) for k, v in named_values(model, g).items())
    lookup = lambda r: ref[r.name]  # noqa: E731
    with torch.no_grad():
        for op in g.ops:
            out = call_target(op.target, map_tensor_refs(op.args, lookup),
                              {k: map_tensor_refs(v, lookup) for k, v in op.kwargs})
            ref.update(zip(op.outputs, tuple(out) if op.returns == "list" else (out,)))
    return ref


def _global_slice(t: Any, x: str, mb: int, intervals: Any, whole: torch.Tensor) -> torch.Tensor:
    """The values of a part's ``intervals`` (micro-batch-local coordinates when the plan has
    micro-batches) of tensor ``x`` in micro-batch ``mb``, cut out of the whole batch's."""
    box = t.boxes[mb].get(x) if t.microbatches > 1 and t.boxes else None
    out = whole
    for d, ivs in enumerate(intervals):
        local = [i for a, b in ivs for i in range(a, b)]
        if box is not None:
            positions = [i for a, b in box[d] for i in range(a, b)]
            local = [positions[i] for i in local]
        if local != list(range(whole.shape[d])):
            out = out.index_select(d, torch.tensor(local, dtype=torch.long))
    return out


def _param_span(m: Materialized, problems) -> Any:
    """The plan statement of a part reading the first parameter a problem names, if any."""
    g = m.transformed.graph
    for name, qual in g.params.items():
        if any(qual in p for p in problems):
            for (tensor, op, _slot, device, _part), _ in m.sources.items():
                if tensor == name:
                    part = m.part_on(op, device)
                    if part is not None and (part.span or part.assigned_at):
                        return part.span or part.assigned_at
    return None
