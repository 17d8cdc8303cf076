"""Checkpoints: each rank saves its own shards; a merge gives an ordinary single-device state dict.

A checkpoint is a directory::

    ckpt/
      rank0.pt ... rankN-1.pt   # this rank's parameter shards and their optimizer state
      meta.json                 # written last, by rank 0: the checkpoint is complete when it exists

Every file is written to a temporary name beside it and renamed into place, so a reader never sees
half a file, and with the mode a new file gets under the user's umask (0644 usually).

A shard is ``(qualified name, region, tensor)``: the region says which part of the full tensor it
holds, so the merge (``merge_checkpoint``) needs nothing but the files, and a run can resume from
a checkpoint written under another plan or another number of ranks: each rank takes, from the
merged tensors, the regions its own parts read. Optimizer state is stored per shard; a state
tensor of the shard's shape is element-wise (SGD's momentum, Adam's moments) and is merged like
the parameter; anything else (Adam's step count) is the same on every shard and is kept once.
Tied parameters (``lm_head.weight`` is ``wte.weight``) appear under every name the model's
``state_dict`` has for them, so ``model.load_state_dict(merged["model"])`` is strict.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ssdsl.errors import SsdslError
from ssdsl.ir.region import Region

CHECKPOINT_VERSION = 1
Shard = tuple[str, Region, torch.Tensor]


class CheckpointError(SsdslError):
    """A checkpoint directory that is missing, incomplete or from another model."""


def _refuse_zero(program: Any) -> None:
    """The optimizer state of a ZeRO-sharded bucket is kept per chunk of the flat bucket, not
    per parameter shard, which is what a checkpoint stores: refused rather than lost."""
    shards = getattr(program, "zero", None)
    if shards:
        span = next(iter(shards.values())).ins.span
        raise CheckpointError("checkpoints of the optimizer state of ZeRO-sharded weights are "
                              "not written or loaded by this version of ssdsl", span,
                              hint="train without --checkpoint/--resume, or remove the zero "
                              "statement")


# ----------------------------------------------------------------------------- files


def write_atomically(path: Path, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file renamed into place; the file
    gets the mode of a newly created file (``0666`` less the umask), not mkstemp's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- one rank


def rank_checkpoint(program: Any, *, step: int, state_keys: Sequence[str],
                    untraced: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """What rank ``program.rank`` saves: its parameter and buffer shards, and the optimizer
    state of each parameter shard. ``state_keys``: the model's ``state_dict`` names (for tied
    parameters and persistent buffers); ``step``: the number of steps trained so far."""
    _refuse_zero(program)
    graph = program.graph
    params, opt_state = [], []
    for (name, region), leaf in program.state.leaves.items():
        qual = graph.params[name]
        params.append((qual, region, leaf.detach().cpu().clone()))
        state = program.opt.state.get(leaf, {})
        opt_state.append((qual, region, {k: (v.detach().cpu().clone()
                                             if isinstance(v, torch.Tensor) else v)
                                         for k, v in state.items()}))
    buffers = [(graph.buffers[name], region, t.detach().cpu().clone())
               for (name, region), t in program.state.fixed.items() if name in graph.buffers]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in program.opt.param_groups]
    return {"version": CHECKPOINT_VERSION, "step": step, "params": params, "buffers": buffers,
            "optimizer": opt_state, "param_groups": groups,
            "aliases": {q: list(a) for q, a in graph.aliases.items()},
            "state_keys": list(state_keys), "untraced": dict(untraced or {})}


def save_rank(directory: str | Path, rank: int, data: Mapping[str, Any]) -> Path:
    """Write one rank's file (``rank{r}.pt``), atomically."""
    path = Path(directory) / f"rank{rank}.pt"
    write_atomically(path, dict(data))
    return path


def finish_checkpoint(directory: str | Path, *, world: int, step: int, model: str,
                      plan: str) -> None:
    """Rank 0, after every rank's file is written: ``meta.json``, the completion mark."""
    path = Path(directory) / "meta.json"
    tmp = path.with_name(".meta.json.tmp")
    tmp.write_text(json.dumps({"version": CHECKPOINT_VERSION, "world": world, "step": step,
                               "model": model, "plan": plan}, indent=1) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- merging


def merge_shards(shards: Iterable[Shard]) -> dict[str, torch.Tensor]:
    """Full tensors from shards (a region held by several ranks, a replica, is taken once);
    copies whose regions overlap unequally (a partition nested in one part) hold the same values
    where they overlap: each is written over the tensor, never added."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, Region]] = set()
    for qual, region, t in shards:
        if (qual, region) in seen:
            continue
        seen.add((qual, region))
        full = out.setdefault(qual, torch.zeros(region.shape, dtype=t.dtype))
        Region.full(region.shape).copy_into(full, region, t)
    return out


def model_state(params: Iterable[Shard], buffers: Iterable[Shard] = (), *,
                aliases: Mapping[str, Sequence[str]], state_keys: Sequence[str] = (),
                untraced: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
    """A state dict the plain model loads strictly: merged parameters under every tied name,
    merged buffers, in the order (and, when ``state_keys`` is given, with only the keys) of the
    model's own ``state_dict``. ``untraced``: the entries the traced step never reads (an
    unused submodule, a buffer kept for bookkeeping), which training leaves as built."""
    merged = merge_shards(params)
    for k, v in (untraced or {}).items():
        merged.setdefault(k, v)
    merged.update({k: v for k, v in merge_shards(buffers).items() if k not in merged})
    for qual, others in aliases.items():
        if qual in merged:
            for other in others:
                merged.setdefault(other, merged[qual])  # one tensor, as in the model
    if not state_keys:
        return merged
    return {k: merged[k] for k in state_keys if k in merged}


def merge_optimizer(entries: Iterable[tuple[str, Region, Mapping[str, Any]]]
                    ) -> dict[str, dict[str, Any]]:
    """Per parameter (qualified name), its optimizer state as full tensors."""
    elementwise: dict[str, list[Shard]] = {}
    out: dict[str, dict[str, Any]] = {}
    for qual, region, state in entries:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == region.local_shape \
                    and value.dim() > 0:
                elementwise.setdefault(f"{qual}\0{key}", []).append((qual, region, value))
            else:
                out.setdefault(qual, {}).setdefault(key, value)
    for joined, shards in elementwise.items():
        qual, key = joined.split("\0")
        out.setdefault(qual, {})[key] = merge_shards(shards)[qual]
    return out


def read_checkpoint(directory: str | Path) -> list[dict[str, Any]]:
    """Every rank's file of a complete checkpoint."""
    d = Path(directory)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{d} is not a complete ssdsl checkpoint (no meta.json)",
                              hint="a checkpoint is the directory --checkpoint wrote; a run "
                              "that stopped while saving leaves none")
    meta = json.loads(meta_path.read_text())
    if meta.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{d}: checkpoint version {meta.get('version')} is not "
                              f"{CHECKPOINT_VERSION}, the one this ssdsl reads")
    files = [d / f"rank{r}.pt" for r in range(int(meta["world"]))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{d}: missing {', '.join(missing)}")
    return [torch.load(f, weights_only=False) for f in files]


def merge_checkpoint(directory: str | Path) -> dict[str, Any]:
    """``{"model": state_dict, "optimizer": {name: state}, "param_groups": ..., "step": n}``,
    ``model`` loadable into the single-device model with ``load_state_dict`` (strict)."""
    ranks = read_checkpoint(directory)
    first = ranks[0]
    optimizer = merge_optimizer(e for r in ranks for e in r["optimizer"])
    for qual, others in first["aliases"].items():  # a tied parameter under each of its names
        if qual in optimizer:
            for other in others:
                optimizer.setdefault(other, optimizer[qual])
    return {"version": CHECKPOINT_VERSION, "step": first["step"],
            "model": model_state((s for r in ranks for s in r["params"]),
                                 (s for r in ranks for s in r["buffers"]),
                                 aliases=first["aliases"], state_keys=first["state_keys"],
                                 untraced=next((r["untraced"] for r in ranks
                                                if r.get("untraced")), None)),
            "optimizer": optimizer, "param_groups": first["param_groups"]}


# ----------------------------------------------------------------------------- resuming


def load_into(program: Any, merged: Mapping[str, Any]) -> int:
    """Put the merged parameters (and optimizer state, when ``merged`` has it) into this rank's
    shards; returns the step to continue from (0 for a plain state dict).

    ``merged`` is ``merge_checkpoint(...)`` or a plain single-device state dict (``--load``).
    """
    model = merged.get("model", merged) if _is_checkpoint(merged) else merged
    opt_state = merged.get("optimizer", {}) if _is_checkpoint(merged) else {}
    if opt_state:
        _refuse_zero(program)
    graph = program.graph
    missing = []
    with torch.no_grad():
        for (name, region), leaf in program.state.leaves.items():
            qual = graph.params[name]
            full = _lookup(model, qual, graph.aliases.get(qual, ()))
            if full is None:
                missing.append(qual)
                continue
            if tuple(full.shape) != tuple(region.shape):
                raise CheckpointError(f"'{qual}' has shape {tuple(full.shape)} in the checkpoint "
                                      f"but {tuple(region.shape)} in the model")
            leaf.copy_(region.slice_of(full.to(leaf.dtype)))
            state = _lookup(opt_state, qual, graph.aliases.get(qual, ()))
            if state:
                program.opt.state[leaf] = {
                    k: (region.slice_of(v).to(leaf.dtype).clone()
                        if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(region.shape)
                        and v.dim() > 0 else (v.clone() if isinstance(v, torch.Tensor) else v))
                    for k, v in state.items()}
    if missing:
        raise CheckpointError(f"the checkpoint has no value for {', '.join(sorted(missing)[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}",
                              hint="was it saved from another model file?")
    return int(merged.get("step", 0)) if _is_checkpoint(merged) else 0


def _is_checkpoint(obj: Mapping[str, Any]) -> bool:
    return "model" in obj and "version" in obj and isinstance(obj.get("model"), Mapping)


def _lookup(state: Mapping[str, torch.Tensor], qual: str, aliases: Sequence[str]
            ) -> torch.Tensor | None:
    for name in (qual, *aliases):
        if name in state:
            return state[name]
    return None


# ----------------------------------------------------------------------------- inside a job


def untraced_state(source: Any, graph: Any, state_keys: Sequence[str],
                   dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` entries that no traced operator reads (a submodule the
    forward never calls, a persistent buffer kept for bookkeeping), whole, from the job's
    initial state ``source`` (its state file, or the seeded model): no rank holds a shard of
    them, and training leaves them as built (they get no gradient), so a saved state takes
    them from there. Floats in ``dtype``, as ``model.to(dtype)`` casts them."""
    from ssdsl.runtime.init import read_entry
    read = {name for op in graph.ops for name in op.inputs}
    held = {qual for name, qual in {**graph.params, **graph.buffers}.items() if name in read}
    for qual in list(held):
        held.update(graph.aliases.get(qual, ()))
    out: dict[str, torch.Tensor] = {}
    for key in state_keys:
        if key in held:
            continue
        value = read_entry(source, key)
        if value is not None:
            out[key] = value.to(dtype) if dtype is not None and value.is_floating_point() \
                else value
    return out


def state_keys_of(model_file: Any, *, seed: int = 0) -> list[str]:
    """The names of the model's ``state_dict``, from a build on the meta device (nothing is
    allocated): tied parameters under each name, persistent buffers only."""
    with torch.device("meta"):
        return list(model_file.build(seed=seed).state_dict())


def program_shards(program: Any) -> tuple[list[Shard], list[Shard]]:
    """This rank's parameter shards and buffer shards, by qualified name (to gather and merge)."""
    graph = program.graph
    params = list(program.shards())
    buffers = [(graph.buffers[name], region, t.detach().cpu().clone())
               for (name, region), t in program.state.fixed.items() if name in graph.buffers]
    return params, buffers


def save_program(program: Any, directory: str | Path, *, step: int, state_keys: Sequence[str],
                 model: str, plan: str, untraced: Mapping[str, torch.Tensor] | None = None
                 ) -> None:
    """Every rank writes its file; after a barrier rank 0 marks the checkpoint complete.
    Collective: every rank of the job must call it."""
    import torch.distributed as dist

    save_rank(directory, program.rank, rank_checkpoint(program, step=step, state_keys=state_keys,
                                                       untraced=untraced))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():
        dist.barrier()
    if program.rank == 0:
        finish_checkpoint(directory, world=world, step=step, model=model, plan=plan)


def load_source(path: str | Path) -> Mapping[str, Any]:
    """A checkpoint directory (merged), a merged checkpoint file, or a plain state-dict file."""
    p = Path(path)
    if p.is_dir():
        return merge_checkpoint(p)
    if not p.is_file():
        raise CheckpointError(f"no checkpoint at {p}",
                              hint="give the directory --checkpoint wrote, or a state-dict file")
    try:
        data = torch.load(p, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same mistake
        raise CheckpointError(f"{p} is neither a checkpoint nor a state dict: torch.load says "
                              f"{type(exc).__name__}: {str(exc)[:200]}",
                              hint="give the directory --checkpoint wrote, a file `ssdsl merge` "
                              "or --save wrote, or a state dict saved with torch.save") from exc
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{p} holds a {type(data).__name__}, not a state dict",
                              hint="save `model.state_dict()`, not the model itself")
    return data


def checkpoint_step(path: str | Path) -> int:
    """The number of steps a checkpoint has trained (0 for a plain state dict), without loading
    its tensors when it is a directory."""
    p = Path(path)
    if p.is_dir():
        meta = p / "meta.json"
        if not meta.is_file():
            read_checkpoint(p)  # raises the error that says what is wrong
        return int(json.loads(meta.read_text())["step"])
    data = load_source(p)
    return int(data.get("step", 0)) if _is_checkpoint(data) else 0


def is_state_dict_file(path: str | Path) -> bool:
    """Whether ``path`` is a plain state-dict file (parameters only, no step or optimizer)."""
    p = Path(path)
    return p.is_file() and not _is_checkpoint(load_source(p))


def resume_program(program: Any, path: str | Path) -> int:
    """Load ``path`` into this rank's shards and optimizer; the step to continue from."""
    return load_into(program, load_source(path))
