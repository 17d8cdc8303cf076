"""``ssdsl run MODEL PLAN``: train with a plan on N local processes (or under torchrun).

Every option is registered in ``register`` below, grouped as ``--help`` shows them; the job is
described by ``JobSpec`` (``ssdsl.runtime.job``), which every rank rebuilds the plan from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ssdsl.cli.check import parse_sets
from ssdsl.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a model file with a plan on torch.distributed",
                       description="Train MODEL with PLAN on --world local processes (gloo on "
                       "CPU, nccl on GPUs), or in this process under torchrun. Output: one "
                       "line per step (a live panel on a terminal), then a summary.")
    p.add_argument("model", help="the model file (.py)")
    p.add_argument("plan", help="a .ssp file or a stdlib plan name")

    job = p.add_argument_group("the job")
    job.add_argument("--world", "--nproc", dest="world", type=int, default=None, metavar="N",
                     help="number of ranks (local processes); under torchrun, its world size "
                     "(default: 1, or torchrun's)")
    job.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="a plan parameter (repeatable)")
    job.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    job.add_argument("--batch-size", type=int, default=None, metavar="B",
                     help="the global batch size (default: the model file's BATCH_SIZE, or 8)")
    job.add_argument("--seed", type=int, default=0,
                     help="seed of the model's initial parameters (default: %(default)s)")
    job.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
                     help="parameter and activation dtype; bfloat16: float32 parameters, the "
                     "forward under torch.autocast to bfloat16 (default: %(default)s)")
    job.add_argument("--optimizer", choices=("model", "sgd", "adamw"), default="model",
                     help="the model file's make_optimizer, plain SGD or AdamW "
                     "(default: %(default)s)")
    job.add_argument("--lr", type=float, default=None,
                     help="learning rate: of every parameter group of the model file's optimizer, "
                     "or of --optimizer sgd|adamw (default: the model file's; for adamw only when "
                     "that optimizer is Adam-like, else AdamW's default)")
    job.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                     help="end the whole job after this long (default: %(default)g)")
    job.add_argument("--compiled", metavar="DIR", default=None,
                     help="run the per-rank files `ssdsl compile` wrote into DIR (rank<N>.py) "
                     "instead of interpreting the plan (default: interpret)")

    check = p.add_argument_group("checking")
    check.add_argument("--check", action="store_true",
                       help="also train the single-device reference and compare every step's "
                       "loss and the final parameters (exit status 1 on a mismatch)")
    check.add_argument("--no-verify", action="store_true",
                       help="skip the check before launch (one step of all ranks simulated in "
                       "this process against the plain model); the output then says it was "
                       "skipped")

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout (docs/json.md); progress lines "
                     "go to stderr")
    out.add_argument("--metrics", metavar="FILE", default=None,
                     help="write one JSON line per step to FILE as it completes (docs/json.md)")

    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--save", metavar="FILE", default=None,
                      help="write the final parameters, merged into one single-device state "
                      "dict (torch.save), atomically; an existing FILE is never overwritten")
    ckpt.add_argument("--checkpoint", metavar="DIR", default=None,
                      help="write a sharded checkpoint at the end: one file per rank with its "
                      "shards and optimizer state (merge with `ssdsl merge DIR`)")
    ckpt.add_argument("--resume", metavar="PATH", default=None,
                      help="start from a checkpoint directory (parameters, optimizer state, "
                      "step; --steps counts from 0) or from a state-dict file (parameters)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    sets = parse_sets(args.set)
    rank = torchrun_rank()
    if rank is None:
        # the ranks' fork server loads torch and ssdsl now, beside this process's planning
        from ssdsl.runtime.forkserver import prestart
        prestart()
    progress = _progress(args, rank)
    with progress:
        # The first line, before torch is imported (which takes seconds on a busy machine).
        progress.phase("planning (trace the model, apply and check the plan)")
        from ssdsl.runtime.job import JobSpec  # the runtime: torch, torch.distributed
        world = _world(args, sets, torchrun=rank is not None)
        first_step = _first_step(args)
        progress.configure(nproc=1 if rank is not None else world,
                           steps=args.steps - first_step, first_step=first_step)
        spec = JobSpec(args.model, args.plan, tuple(sets.items()), args.steps,
                       args.batch_size, args.seed, args.dtype, args.optimizer, args.lr,
                       resume=args.resume, checkpoint=args.checkpoint, compiled=args.compiled)
        result = _train(spec, args, progress, world=world, rank=rank)
    if result is None:
        return 0  # a rank other than 0 under torchrun: rank 0 reports
    result, verification = result
    if args.save:
        _saved_at(Path(args.save), save_atomically(result["params"], Path(args.save)))
    verdict, precision = None, None
    if args.check:
        progress.after(f"checking: training the single-device reference for {args.steps} "
                       f"step{'s' if args.steps != 1 else ''} and comparing")
        verdict, precision = _check(args, spec, result, first_step)
    if args.json:
        doc = run_json(args, spec, result, progress, verdict)
        doc["verify"] = verification.as_dict()
        doc["check_precision"] = precision.note() if precision is not None else None
        print(json.dumps(doc, indent=2, default=str))
    else:
        if precision is not None and precision.note():
            print(f"note: {precision.note()}")
        _print_summary(result, progress, verdict)
    return 0 if verdict is None or verdict.ok else 1


def _check_flags(args: argparse.Namespace) -> None:
    for flag in ("steps", "batch_size", "world"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
    if not args.timeout > 0:  # the job would be stopped as soon as it started
        raise UsageError(f"--timeout must be above 0 seconds, not {args.timeout:g}")
    if args.lr is not None and not args.lr >= 0:  # else every rank fails in torch.optim
        raise UsageError(f"--lr must be at least 0, not {args.lr:g}")
    if args.save and Path(args.save).exists():
        raise UsageError(f"--save: {args.save} exists; ssdsl does not overwrite files",
                         hint="choose a new file name or remove the old one")
    if args.metrics and Path(args.metrics).exists():
        raise UsageError(f"--metrics: {args.metrics} exists; ssdsl does not overwrite files",
                         hint="choose a new file name or remove the old one")
    if args.checkpoint:
        folder = Path(args.checkpoint)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--checkpoint: {folder} is a file, not a directory",
                             hint="give a new directory; each rank writes its file into it")
        if folder.exists() and any(folder.iterdir()):
            raise UsageError(f"--checkpoint: {folder} exists and is not empty; ssdsl does "
                             "not overwrite checkpoints", hint="choose a new directory")
        _writable("--checkpoint", folder)  # before training, not after it
    if args.metrics:
        _writable("--metrics", Path(args.metrics).parent)


def _writable(flag: str, folder: Path) -> None:
    """Refuse, before anything runs, a folder that cannot be made or written: its nearest
    existing ancestor must be a writable directory."""
    import os
    here = folder.absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir() or not os.access(here, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: cannot write into {folder} ({here} is not a writable "
                         "directory)", hint="choose a path you can write")


def _world(args: argparse.Namespace, sets: dict[str, str], *, torchrun: bool) -> int:
    """The number of ranks, said once: --world (or --nproc), or torchrun's world size."""
    import os
    world = args.world
    if torchrun:
        actual = int(os.environ["WORLD_SIZE"])
        if world is not None and world != actual:
            raise UsageError(f"--world {world}, but torchrun started {actual} ranks",
                             hint="leave out --world under torchrun")
        world = actual
    world = world or 1
    if "world" in sets:
        if sets["world"].strip() != str(world):
            raise UsageError(f"--set world={sets['world']} disagrees with the {world} rank"
                             f"{'s' if world > 1 else ''} this run starts",
                             hint=f"the world of `run` is the number of ranks: give --world "
                             f"{sets['world']} instead of --set world=...")
        del sets["world"]
    return world


def _first_step(args: argparse.Namespace) -> int:
    """The step a --resume continues from; a run that would train nothing is refused."""
    if not args.resume:
        return 0
    from ssdsl.runtime.checkpoint import checkpoint_step, is_state_dict_file
    if args.check and is_state_dict_file(args.resume):
        raise UsageError(f"--check compares with the single-device model trained from seed "
                         f"{args.seed}; {args.resume} is a state dict, not a checkpoint of "
                         "such a run", hint="resume from a --checkpoint directory, or leave "
                         "out --check")
    start = checkpoint_step(args.resume)
    if start >= args.steps:
        raise UsageError(f"--resume {args.resume} has trained {start} steps already; --steps "
                         f"{args.steps} leaves nothing to train",
                         hint=f"--steps counts from step 0: give more than {start}")
    return start


def torchrun_rank(environ: Any = None) -> int | None:
    """This process's rank when it is one rank of a job (torchrun's, or one ``launch`` started),
    else None: the rule of ``ssdsl.runtime.launch.under_torchrun``, read here without importing
    torch."""
    import os
    env = os.environ if environ is None else environ
    if all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return int(env["RANK"])
    return None


def _progress(args: argparse.Namespace, rank: int | None) -> Any:
    """What shows the run: lines or a live panel on stdout (stderr under --json), on rank 0 only
    under torchrun; the --metrics file, made now (it is never an existing file)."""
    from ssdsl.runtime.progress import MetricsFile, make_progress
    first = rank is None or rank == 0
    try:
        metrics = MetricsFile(args.metrics) if args.metrics and first else None
    except OSError as exc:
        raise UsageError(f"--metrics: cannot write {args.metrics}: {exc.strerror or exc}",
                         hint="choose a path you can write") from exc
    return make_progress(nproc=args.world or 1, steps=args.steps,
                         title=f"ssdsl run {args.model} {args.plan}", metrics=metrics,
                         stream=sys.stderr if args.json else sys.stdout,
                         live=None if first else False)


def _train(spec: Any, args: argparse.Namespace, progress: Any, *, world: int,
           rank: int | None):
    """Launch (or, under torchrun, be one rank of) the job, showing progress; rank 0's result
    and the verification before launch, or None on the other ranks under torchrun."""
    from ssdsl.runtime.dist import pick_backend
    from ssdsl.runtime.job import for_host, launch_files, rank_main
    from ssdsl.runtime.launch import launch, rank_threads, set_local_event_handler

    device = "cuda" if pick_backend() == "nccl" else "cpu"
    if rank is not None:
        # Under torchrun every rank plans and verifies (the same, deterministic answer), so
        # all stop together; each process sees only its own events, rank 0 shows them. The
        # host decides the lowering once, here, before the plan is checked (torchrun runs as
        # many ranks on every node)
        spec = for_host(spec, device=device)
        verification = _verify(spec, world, args, rank)
        if rank == 0:
            set_local_event_handler(progress.on_event)
        try:
            result = rank_main(spec)
        finally:
            set_local_event_handler(None)
        return None if result is None else (result, verification)
    # Plan once here, exactly as every rank will (they plan from this traced graph, whose
    # programs are checked here): a bad model file or plan fails now, once, with its
    # location and exit status 2, instead of in N processes after they started; then verify
    # it against the plain model (DESIGN §7), or say that it was not.
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    spec = for_host(spec, local=world, threads=rank_threads(world), device=device)
    with launch_files(spec, world) as planned:
        if args.no_verify:
            verification = _verify(spec, world, args, 0, planned=planned.m)
            progress.phase(f"starting {ranks}")
            result = launch(rank_main, nproc=world, args=(planned.spec,),
                            timeout_s=args.timeout, on_event=progress.on_event)[0]
            return result, verification
        progress.phase(f"starting {ranks} while verifying (they wait for it before training)")
        return _launch_verifying(spec, planned, world, args, progress)


def _launch_verifying(spec: Any, planned: Any, world: int, args: argparse.Namespace,
                      progress: Any) -> tuple[Any, Any]:
    """Start the ranks and verify meanwhile, in a thread (``ssdsl.runtime.gate``): the ranks
    start up (processes, imports, process groups, plans, shards) and wait at the gate, which
    opens when verification passes. When it fails, no rank has taken a step: they are stopped
    and its error (at its plan line) is raised. The verification records how long the ranks
    stood at the gate: what verifying added to the start-up."""
    import contextlib
    import os
    import threading
    import time

    import attrs
    import torch

    from ssdsl.runtime.gate import Gate
    from ssdsl.runtime.job import GATE_PHASE, rank_main
    from ssdsl.runtime.launch import launch
    from ssdsl.runtime.preflight import verify_before_launch
    from ssdsl.runtime.progress import Phase

    gate = Gate(Path(planned.spec.graph_file).with_name("gate"))
    done: dict[str, Any] = {}
    arrived: dict[int, float] = {}

    def verify() -> None:
        # below the ranks' priority (Linux: per thread): on few cores the starting ranks come
        # first, and verification takes the cycles they leave (at the gate, all of them)
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        # one thread: the cores are the ranks' (each has its share, ``launch``); an OpenMP
        # team that waits for a core a starting rank holds turns a small float64 product of
        # microseconds into a scheduler slice (16 ms measured here)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            done["verification"] = verify_before_launch(spec, world, planned=planned.m)
        except BaseException as exc:  # noqa: BLE001 - raised in the launching thread
            done["error"] = exc
        finally:
            torch.set_num_threads(threads)
        done["at"] = time.monotonic()
        gate.open() if "error" not in done else gate.refuse()

    def on_event(rank: int, event: Any) -> None:
        if isinstance(event, Phase) and event.name == GATE_PHASE:
            arrived[rank] = time.monotonic()
        progress.on_event(rank, event)

    def settle() -> None:  # once verification is done: its line, or its error
        if "at" not in done or "said" in done:
            return
        done["said"] = True
        if "error" in done:
            raise done["error"]
        ready = max(arrived.values()) if len(arrived) == world else done["at"]
        done["verification"] = attrs.evolve(done["verification"],
                                            held_ranks_s=max(0.0, done["at"] - ready))
        sys.stdout.flush()
        print(done["verification"].line(), file=sys.stderr, flush=True)

    thread = threading.Thread(target=verify, name="ssdsl-verify", daemon=True)
    thread.start()
    try:
        result = launch(rank_main, nproc=world, args=(attrs.evolve(planned.spec,
                                                                    gate_file=str(gate.path)),),
                        timeout_s=args.timeout, on_event=on_event, poll=settle)[0]
    except BaseException:
        # a rank that failed while verification ran: a plan that fails verification is
        # reported by verification, at its line (the ranks' failure is its consequence)
        thread.join()
        settle()
        raise
    thread.join()
    settle()
    return result, done["verification"]


def _verify(spec: Any, world: int, args: argparse.Namespace, rank: int, *,
            planned: Any = None) -> Any:
    """Verification before launch (``ssdsl.runtime.preflight``), its line on stderr (rank 0)."""
    from ssdsl.runtime.preflight import verify_before_launch
    verification = verify_before_launch(spec, world, enabled=not args.no_verify,
                                        planned=planned)
    if rank == 0:  # on stderr, beside errors: a fact about the plan, not progress
        sys.stdout.flush()
        print(verification.line(), file=sys.stderr, flush=True)
    return verification


def _check(args: argparse.Namespace, spec: Any, result: dict, first_step: int):
    """Compare with the single-device reference trained from step 0 (a resumed run must follow
    the uninterrupted trajectory)."""
    from ssdsl.runtime.job import DTYPES
    from ssdsl.runtime.reference import RunRecord, compare_runs, run_reference, tolerance_for
    from ssdsl.runtime.train import OptimizerSpec
    from ssdsl.trace.model_file import load_model_file

    from ssdsl.runtime.train import autocast
    with autocast(args.dtype):  # the reference in the same precision
        ref = run_reference(load_model_file(args.model), steps=args.steps,
                            batch_size=args.batch_size, seed=args.seed,
                            dtype=DTYPES[args.dtype],
                            optimizer=OptimizerSpec(args.optimizer, args.lr))
    mine = RunRecord(losses=tuple(result["losses"]), final_state=result["params"])
    expected = RunRecord(losses=ref.losses[first_step:],
                         final_state={k: v for k, v in ref.final_state.items()
                                      if k in result["params"]})
    import torch
    precision = _precision(args.model, DTYPES[args.dtype])
    check_dtype = torch.bfloat16 if args.dtype == "bfloat16" else precision.dtype
    verdict = compare_runs(expected, mine, tolerance=tolerance_for(check_dtype,
                                                                   reordered_sums=True))
    return verdict, precision


def _precision(model_file: str, dtype):
    """The precision the model computes in under ``dtype`` (``ssdsl.trace.precision``)."""
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.trace.precision import computing_precision
    mf = load_model_file(model_file)
    model = mf.build(seed=0).to(dtype)
    return computing_precision(trace(mf, device="cpu", model=model), dtype)


def communication_text(acc: dict) -> str:
    """``219.0 KiB per step: gradients 1 all_reduce`` from ``Materialized.accounting()``."""
    from ssdsl.runtime.train import human_bytes
    phases = []
    for phase in ("forward", "backward", "gradients"):
        kinds = acc.get(phase) or {}
        if kinds:
            phases.append(f"{phase} " + ", ".join(f"{v['count']} {k} ({human_bytes(v['bytes'])})"
                                                  for k, v in kinds.items()))
    return f"{human_bytes(acc['total_bytes'])} per step" + (": " + "; ".join(phases)
                                                             if phases else "")


def _print_summary(result: dict, progress: Any, verdict: Any) -> None:
    out = sys.stdout
    for line in progress.summary().lines():
        out.write(line + "\n")
    out.write(f"  comm       {communication_text(result['accounting'])}\n")
    if verdict is not None:
        out.write(verdict.summary() + "\n")
    out.flush()


def run_json(args: argparse.Namespace, spec: Any, result: dict, progress: Any,
             verdict: Any) -> dict[str, Any]:
    """The ``ssdsl run --json`` document (docs/json.md)."""
    from ssdsl.cli.jsonout import document
    first = result.get("first_step", 0)
    return document("run", {
            "model": args.model, "plan": args.plan, "params": dict(spec.sets),
            "world": len(result["ranks"]), "steps": args.steps, "first_step": first,
            "batch_size": args.batch_size or _model_batch_size(args.model), "seed": args.seed, "dtype": args.dtype,
            "optimizer": args.optimizer,
            "losses": result["losses"],
            "steps_detail": [r.as_json() for r in progress.rows],
            "summary": progress.summary().as_json(),
            "communication": result["accounting"],
            "ranks": [_rank_json(_asdict(r)) for r in result["ranks"]],
            "check": verdict.as_dict() if verdict else None,
            "ok": True if verdict is None else verdict.ok})


def _model_batch_size(model: str) -> int:
    from ssdsl.trace.model_file import load_model_file
    return load_model_file(model).batch_size


def _rank_json(r: dict) -> dict:
    """A rank's summary with the names and units of the step rows (ms, communication_bytes)."""
    return {"rank": r["rank"], "steps": r["steps"], "median_step_ms": r["median_step_s"] * 1e3,
            "samples_per_s": r["samples_per_s"],
            "communication_bytes_per_step": r["comm_bytes_per_step"],
            "peak_memory_bytes": r["peak_memory_bytes"]}


def save_atomically(state: dict, path: Path) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then link it into place with the mode
    of a new file (0644 under the usual umask); the path written is returned.

    ``os.link`` fails when ``path`` appeared meanwhile, so a file created by someone else between
    the check and the write is never replaced; the trained parameters are then linked under the
    first free name beside it (``model.1.pt``, ``model.2.pt``, ...) instead of being lost. A
    directory that cannot be written falls back to the current directory.
    """
    import os
    import tempfile

    import torch

    from ssdsl.runtime.checkpoint import current_umask
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError:
        path = Path.cwd() / path.name
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600
        for candidate in _fresh_names(path):
            try:
                os.link(tmp, candidate)
                return candidate
            except FileExistsError:
                continue
        raise UsageError(f"--save: {path} and 1,000 names beside it exist; nothing was "
                         "overwritten, and the parameters were not saved")  # pragma: no cover
    finally:
        os.unlink(tmp)


def _fresh_names(path: Path):
    """``path``, then ``stem.1.suffix`` ... ``stem.999.suffix`` beside it."""
    yield path
    for n in range(1, 1000):
        yield path.with_name(f"{path.stem}.{n}{path.suffix}")


def _saved_at(asked: Path, written: Path) -> None:
    """Say where the parameters went when it is not where they were asked to go."""
    if written.parent != asked.parent:
        print(f"--save: {asked.parent} cannot be written; the trained parameters were saved to "
              f"{written}", file=sys.stderr)
    elif written != asked:
        print(f"--save: {asked} appeared while training and was not overwritten; the trained "
              f"parameters were saved to {written}", file=sys.stderr)


def _asdict(r) -> dict:
    import attrs
    return attrs.asdict(r) if attrs.has(type(r)) else dict(r)
