"""Initial shards without the full model on a rank (DESIGN §6).

The initial values must be exactly the single-device model's for the same seed. A model's
initialisation is one pass of the global random generator over all its parameters in
construction order (and ``apply(init_weights)`` passes after it), so the values of one shard
depend on every parameter created before it: no rank can compute its shards alone without
replaying the whole construction. So the values are made once per machine, by a process that
is not training, and each rank reads only its regions:

- ``ssdsl run --nproc N``: the launching process (which plans the job anyway) builds the seeded
  model once and writes its parameters and buffers to a file (``initial_state_file``); it then
  frees them and starts the ranks.
- under ``torchrun`` (no planning parent): local rank 0 of each machine writes the file, the
  others wait at a barrier (``shared_state_file``). That one process holds the full model once,
  before training, and frees it; this is the limit of that path.

A rank memory-maps the file (``torch.load(mmap=True)``) and copies out its regions, so only the
pages of its regions are read (for a region split along the last dim of a small matrix, every
row's page is touched: a rank then reads up to the whole tensor, but holds only its copy). The
rank plans from a trace on the ``meta`` device (``trace_for_ranks``), so it never builds the
model's tensors either; creation operators traced on ``meta`` are moved back to the run's device.

Limits: a model whose traced graph lifts tensor constants (``torch.tensor(...)`` in forward) is
planned from a real trace (its constants have no values on ``meta``), so its ranks still build it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from ssdsl.ir.graph import Graph, Op
from ssdsl.ir.region import Region

_CONST = "constant:"


# -- planning on meta ------------------------------------------------------------------------------


def on_device(graph: Graph, device: str | torch.device) -> Graph:
    """``graph`` with every ``device=meta`` argument of its creation operators set to ``device``."""
    meta = torch.device("meta")
    target = torch.device(device)

    def fix(op: Op) -> Op:
        kwargs = tuple((k, target if k == "device" and v == meta else v) for k, v in op.kwargs)
        return op if kwargs == op.kwargs else attrs.evolve(op, kwargs=kwargs)

    return attrs.evolve(graph, ops=tuple(fix(op) for op in graph.ops))


def has_tensor_constants(graph: Graph) -> bool:
    """Whether the trace lifted tensor constants (which have no values on ``meta``)."""
    return any(isinstance(v, torch.Tensor) for v in graph.constants.values())


# -- the state file ---------------------------------------------------------------------------------


def named_values(model: torch.nn.Module, graph: Graph) -> dict[str, torch.Tensor]:
    """Graph tensor name -> value, for parameters, buffers (through tied names) and constants."""
    by_qual = dict(model.named_parameters(remove_duplicate=False))
    by_qual.update(dict(model.named_buffers(remove_duplicate=False)))
    out: dict[str, torch.Tensor] = {}
    for name, qual in {**graph.params, **graph.buffers}.items():
        for q in (qual, *graph.aliases.get(qual, ())):
            if q in by_qual:
                out[name] = by_qual[q]
                break
    out.update((k, v) for k, v in graph.constants.items() if isinstance(v, torch.Tensor))
    return out


def write_state(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model``'s parameters and buffers (by qualified name, tied ones once) to ``path``
    in the format ``torch.load(mmap=True)`` maps (``torch.save``'s zip format)."""
    path = Path(path)
    state = {k: v.detach() for k, v in model.named_parameters()}
    state.update((k, v.detach()) for k, v in model.named_buffers())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # readers never see half a file
    return path


class StateFile:
    """A written state, memory-mapped: a tensor's pages are read only when sliced."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._state = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")

    def values(self, graph: Graph) -> dict[str, torch.Tensor]:
        """Graph tensor name -> mapped tensor (parameters and buffers) and graph constants."""
        out: dict[str, torch.Tensor] = {}
        for name, qual in {**graph.params, **graph.buffers}.items():
            for q in (qual, *graph.aliases.get(qual, ())):
                if q in self._state:
                    out[name] = self._state[q]
                    break
        out.update((k, v) for k, v in graph.constants.items() if isinstance(v, torch.Tensor))
        return out


Source = torch.nn.Module | StateFile


def init_shards(m: Any, rank: int, source: Source
                ) -> tuple[dict[tuple[str, Region], torch.Tensor],
                           dict[tuple[str, Region], torch.Tensor]]:
    """This rank's parameter shards (leaves requiring grad) and fixed tensors (buffers,
    constants), keyed by (graph tensor name, region), copied from ``source``: a live seeded
    model, or a ``StateFile`` of one (only the regions' pages are read)."""
    graph = m.transformed.graph
    full = named_values(source, graph) if isinstance(source, torch.nn.Module) \
        else source.values(graph)
    leaves: dict[tuple[str, Region], torch.Tensor] = {}
    fixed: dict[tuple[str, Region], torch.Tensor] = {}
    dtype = m.dtype
    for (name, _op, _slot, device), use in m.sources.items():
        if device != rank or name not in full:
            continue
        key = (name, use.region)
        into = leaves if name in graph.params else fixed
        if key in into:
            continue
        value = use.region.slice_of(full[name]).detach()
        # a copy of the region only (also out of a mapped file); floats in the run's dtype
        value = value.to(dtype=dtype, copy=True) if value.is_floating_point() else value.clone()
        into[key] = value.requires_grad_(True) if into is leaves else value
    return leaves, fixed


# -- who writes it ---------------------------------------------------------------------------------


@contextlib.contextmanager
def initial_state_file(model_file: Any, *, seed: int) -> Iterator[str]:
    """A state file of the seeded model, in a temporary directory removed on exit (the
    launching process of ``ssdsl run --nproc`` writes it once, before the ranks start)."""
    model = model_file.build(seed=seed)
    with tempfile.TemporaryDirectory(prefix="ssdsl-init-") as tmp:
        path = write_state(model, Path(tmp) / "initial_state.pt")
        del model
        yield str(path)


def shared_state_file(model_file: Any, *, seed: int, local_rank: int, barrier,
                      key: str) -> StateFile:
    """Under torchrun: local rank 0 writes the seeded model's state to a machine-local file,
    every local rank maps it after ``barrier()``. ``key`` names the job (same on all ranks)."""
    digest = hashlib.sha1(f"{key}:{seed}:{model_file.path}".encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"ssdsl-init-{digest}.pt"
    if local_rank == 0:
        model = model_file.build(seed=seed)
        write_state(model, path)
        del model
    barrier()
    state = StateFile(path)
    barrier()  # everyone has it mapped: the name can go (the mapping keeps the data)
    if local_rank == 0:
        with contextlib.suppress(OSError):
            path.unlink()
    return state
