"""``ssdsl run MODEL PLAN``: train with a plan on N local processes (or under torchrun)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import attrs
from rich.console import Console

from ssdsl.cli.check import parse_sets
from ssdsl.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a model file with a plan on torch.distributed",
                       description="Train MODEL with PLAN on --nproc local processes (gloo on "
                       "CPU, nccl on GPUs), or in this process under torchrun.")
    p.add_argument("model", help="the model file (.py)")
    p.add_argument("plan", help="a .ssp file or a stdlib plan name")
    p.add_argument("--nproc", type=int, default=None, help="local processes (default: 1)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a plan parameter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--optimizer", choices=("model", "sgd", "adamw"), default="model")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--check", action="store_true",
                   help="also train the single-device reference and compare")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the check before launch (one step of all ranks simulated in this "
                   "process against the plain model); the output then says it was skipped")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    p.add_argument("--save", metavar="FILE", default=None,
                   help="write the final parameters, merged into one single-device state dict "
                   "(torch.save), atomically; an existing FILE is never overwritten")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the job is ended")
    p.add_argument("--compiled", metavar="DIR", default=None,
                   help="run the per-rank files `ssdsl compile` wrote into DIR (rank<N>.py)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the runtime pulls in torch.distributed, which other commands do not need.
    from ssdsl.runtime.job import DTYPES, JobSpec, rank_main
    from ssdsl.runtime.launch import launch, under_torchrun
    from ssdsl.runtime.reference import compare_runs, run_reference, tolerance_for, RunRecord
    from ssdsl.runtime.train import OptimizerSpec
    from ssdsl.trace.model_file import load_model_file

    for flag in ("steps", "batch_size", "nproc"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
    if args.save and Path(args.save).exists():
        raise UsageError(f"--save: {args.save} exists; ssdsl does not overwrite files",
                         hint="choose a new file name or remove the old one")
    spec = JobSpec(args.model, args.plan, tuple(parse_sets(args.set).items()), args.steps, args.batch_size,
                   args.seed, args.dtype, args.optimizer, args.lr, compiled=args.compiled)
    from ssdsl.runtime.init import initial_state_file
    from ssdsl.runtime.preflight import verify_before_launch
    if under_torchrun():
        # every rank verifies (the same, deterministic answer), so that all of them stop together
        verification = verify_before_launch(spec, int(os.environ["WORLD_SIZE"]),
                                            enabled=not args.no_verify)
        if os.environ.get("RANK") == "0":
            print(verification.line(), file=sys.stderr)
        result = rank_main(spec)
        if result is None:
            return 0
        nproc = len(result["ranks"])
    else:
        nproc = args.nproc or 1
        # Plan once here, exactly as every rank will: a bad model file or plan fails now, once,
        # with its location and exit status 2, instead of in N processes after they started;
        # and verify it against the plain model (DESIGN §7), or say that it was not.
        verification = verify_before_launch(spec, nproc, enabled=not args.no_verify)
        print(verification.line(), file=sys.stderr)
        # the seeded model's state, written once here: each rank maps it and copies its regions
        with initial_state_file(load_model_file(args.model), seed=args.seed) as init_file:
            ranks = attrs.evolve(spec, init_file=init_file)
            if args.json:
                result = launch(rank_main, nproc=nproc, args=(ranks,), timeout_s=args.timeout)[0]
            else:
                from ssdsl.runtime.train import LiveView
                with LiveView(nproc=nproc, steps=args.steps,
                              title=f"ssdsl run {args.model} {args.plan}") as view:
                    result = launch(rank_main, nproc=nproc, args=(ranks,),
                                    timeout_s=args.timeout, on_event=view.on_event)[0]
    if args.save:
        _saved_at(Path(args.save), save_atomically(result["params"], Path(args.save)))
    console = Console(file=sys.stdout, soft_wrap=True)
    verdict = None
    if args.check:
        ref = run_reference(load_model_file(args.model), steps=args.steps,
                            batch_size=args.batch_size, seed=args.seed,
                            dtype=DTYPES[args.dtype],
                            optimizer=OptimizerSpec(args.optimizer, args.lr))
        mine = RunRecord(losses=tuple(result["losses"]), final_state=result["params"])
        expected = RunRecord(losses=ref.losses,
                             final_state={k: v for k, v in ref.final_state.items()
                                          if k in result["params"]})
        precision = _precision(args.model, DTYPES[args.dtype])
        verdict = compare_runs(expected, mine, tolerance=tolerance_for(
            precision.dtype, reordered_sums=True))
    if args.json:
        import json
        out = {"model": args.model, "plan": args.plan, "nproc": nproc, "steps": args.steps,
               "losses": result["losses"], "accounting": result["accounting"],
               "ranks": [_asdict(r) for r in result["ranks"]],
               "check": verdict.as_dict() if verdict else None,
               "check_precision": precision.note() if verdict else None,
               "verify": verification.as_dict(),
               "ok": None if verdict is None else verdict.ok}
        print(json.dumps(out, indent=2, default=str))
    else:
        for i, loss in enumerate(result["losses"]):
            console.print(f"step {i:>4}  loss {loss:.6f}")
        acc = result["accounting"]
        console.print(f"communication per step: {acc['total_bytes']:,} bytes "
                      f"(forward {acc['forward']}, backward {acc['backward']}, "
                      f"gradients {acc['gradients']})")
        for r in result["ranks"]:
            rr = _asdict(r)
            console.print(f"rank {rr['rank']}: {rr['median_step_s'] * 1e3:.1f} ms/step, "
                          f"{rr['samples_per_s']:.1f} samples/s, peak memory "
                          f"{rr['peak_memory_bytes'] / 2**20:.0f} MiB")
        if verdict is not None:
            if precision.note():
                console.print(f"note: {precision.note()}")
            console.print(verdict.summary())
    return 0 if verdict is None or verdict.ok else 1


def _precision(model_file: str, dtype):
    """The precision the model computes in under ``dtype`` (``ssdsl.trace.precision``)."""
    import torch
    from ssdsl.trace import trace
    from ssdsl.trace.model_file import load_model_file
    from ssdsl.trace.precision import computing_precision
    mf = load_model_file(model_file)
    model = mf.build(seed=0).to(dtype)
    return computing_precision(trace(mf, device="cpu", model=model), dtype)


def save_atomically(state: dict, path: Path) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then link it into place; the path
    written is returned.

    ``os.link`` fails when ``path`` appeared meanwhile, so a file created by someone else between
    the check and the write is never replaced; the trained parameters are then linked under the
    first free name beside it (``model.1.pt``, ``model.2.pt``, ...) instead of being lost. A
    directory that cannot be written falls back to the current directory.
    """
    import os
    import tempfile
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
