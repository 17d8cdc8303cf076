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
- under ``torchrun`` (no planning parent): local rank 0 of each machine has the file written
  by a child process it starts and waits for, the others wait for the file to appear
  (``shared_state_file``; not at a collective, whose timeout a large model would outlast). The child holds the full model once and exits; no rank does.

A rank reads its regions out of the file with positioned reads (one per contiguous run), so it
reads exactly their bytes; memory-mapping was tried first and measured worse: the kernel maps
the neighbouring pages of every fault (64 KiB), so a rank reading a column block of every row
counted nearly the whole file in its memory. The rank plans from a trace on the ``meta`` device
(``ssdsl.runtime.job.plan_for_ranks``), so it never builds the
model's tensors either; creation operators traced on ``meta`` are moved back to the run's device.

Limits: a model whose traced graph lifts tensor constants (``torch.tensor(...)`` in forward) is
planned from a real trace (its constants have no values on ``meta``), so its ranks still build it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import struct
import subprocess
import sys
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
    """``graph`` with every ``meta`` device argument of its operators (``arange(..., device=)``,
    ``to(x, device, dtype)``) set to ``device``."""
    meta = torch.device("meta")
    target = torch.device(device)

    def swap(v: Any) -> Any:  # a device argument, by keyword or by position (``to.device``)
        if isinstance(v, torch.device):
            return target if v == meta else v
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(swap(x) for x in v)
        return v

    def fix(op: Op) -> Op:
        args, kwargs = swap(op.args), tuple((k, swap(v)) for k, v in op.kwargs)
        return op if (args, kwargs) == (op.args, op.kwargs) else \
            attrs.evolve(op, args=args, kwargs=kwargs)

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


_MAGIC = b"SSDSL-STATE-1\n"


def write_state(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model``'s parameters and buffers (by qualified name, tied ones once) to ``path``:
    a JSON header (name -> dtype, shape, byte offset) then each tensor's bytes, row-major, so a
    reader can fetch any region with positioned reads (``StateFile``)."""
    path = Path(path)
    named = {k: v.detach() for k, v in model.named_parameters()}
    named.update((k, v.detach()) for k, v in model.named_buffers())
    header, offset = {}, 0
    for name, t in named.items():
        header[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset}
        offset += t.numel() * t.element_size()
    head = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(_MAGIC + struct.pack("<Q", len(head)) + head)
        for t in named.values():
            if t.numel():
                f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers never see half a file
    return path


class StateFile:
    """A written state, read region by region with positioned reads: a rank reads exactly the
    bytes of its regions (no mapping, so no neighbouring pages count in its memory)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise ValueError(f"{self.path} is not an ssdsl state file")
            (n,) = struct.unpack("<Q", f.read(8))
            self._header = json.loads(f.read(n))
            self._base = len(_MAGIC) + 8 + n
        # kept open: the writer may remove the name once every rank has opened it
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            os.close(self._fd)

    def read(self, graph: Graph, name: str, region: Region) -> torch.Tensor | None:
        """``region`` of graph tensor ``name`` (a parameter or buffer), None if not stored."""
        qual = {**graph.params, **graph.buffers}.get(name)
        found = next((q for q in (qual, *graph.aliases.get(qual, ())) if q in self._header),
                     None) if qual else None
        return None if found is None else self.read_entry(found, region)

    def read_entry(self, qual: str, region: Region | None = None) -> torch.Tensor | None:
        """``region`` (default: all) of the state entry stored under ``qual``, None if none."""
        entry = self._header.get(qual)
        if entry is None:
            return None
        if region is None:
            region = Region.full(tuple(entry["shape"]))
        dtype = getattr(torch, entry["dtype"])
        out = torch.empty(region.local_shape, dtype=dtype)
        if out.numel() == 0:
            return out
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        item = out.element_size()
        at = 0
        for offset, length in _spans(tuple(entry["shape"]), region.intervals):
            n = length * item
            got = os.preadv(self._fd, [buf[at:at + n]], self._base + entry["offset"] + offset * item)
            if got != n:
                raise OSError(f"{self.path}: short read of '{qual}'")
            at += n
        return out


def read_entry(source: Any, qual: str) -> torch.Tensor | None:
    """The whole value of the model's state entry ``qual`` in ``source`` (a ``StateFile``, or
    the seeded model itself), None where it holds none."""
    if isinstance(source, torch.nn.Module):
        got = source.state_dict().get(qual)
        return None if got is None else got.detach().clone()
    if isinstance(source, StateFile):
        return source.read_entry(qual)
    return None


def _spans(shape: tuple[int, ...], intervals: tuple) -> Iterator[tuple[int, int]]:
    """(element offset, element count) of the contiguous runs of a region of a row-major
    tensor, in the region's own row-major order (trailing whole dims merge into one run)."""
    if not shape:
        yield 0, 1
        return
    k = len(shape) - 1
    while k > 0 and tuple(intervals[k]) == ((0, shape[k]),):
        k -= 1
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    lead = [[i for a, b in intervals[d] for i in range(a, b)] for d in range(k)]
    for idx in itertools.product(*lead):
        base = sum(i * strides[d] for d, i in enumerate(idx))
        for a, b in intervals[k]:
            yield base + a * strides[k], (b - a) * strides[k]


class LiveModel:
    """The values of a live seeded model (what every rank built before the state file)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._values: tuple[Graph, dict[str, torch.Tensor]] | None = None

    def read(self, graph: Graph, name: str, region: Region) -> torch.Tensor | None:
        # the model's names are looked up once per graph, not once per region read
        if self._values is None or self._values[0] is not graph:
            self._values = (graph, named_values(self.model, graph))
        full = self._values[1].get(name)
        return None if full is None else region.slice_of(full).detach().clone()


Source = torch.nn.Module | StateFile


def init_shards(m: Any, rank: int, source: Source, *, dtype: torch.dtype | None = None
                ) -> tuple[dict[tuple[str, Region], torch.Tensor],
                           dict[tuple[str, Region], torch.Tensor]]:
    """This rank's parameter shards (leaves requiring grad) and fixed tensors (buffers,
    constants), keyed by (graph tensor name, region), copied from ``source``: a live seeded
    model, or a ``StateFile`` of one (only the regions' bytes are read). Floats are cast to
    ``dtype`` (the plan's, ``m.dtype``, unless given: verification runs a float32 plan's
    programs in float64) as ``model.to(dtype)`` casts them: parameters and buffers, not a
    constant the forward makes (it keeps its traced dtype)."""
    dtype = m.dtype if dtype is None else dtype
    graph = m.transformed.graph
    reader = LiveModel(source) if isinstance(source, torch.nn.Module) else source
    constants = {k: v for k, v in graph.constants.items() if isinstance(v, torch.Tensor)}
    leaves: dict[tuple[str, Region], torch.Tensor] = {}
    fixed: dict[tuple[str, Region], torch.Tensor] = {}
    for (name, _op, _slot, device, _part), use in m.sources.items():
        if device != rank or name in graph.inputs:
            continue
        key = (name, use.region)
        into = leaves if name in graph.params else fixed
        if key in into:
            continue
        value = use.region.slice_of(constants[name]).clone() if name in constants \
            else reader.read(graph, name, use.region)
        if value is None:
            continue
        # readers return fresh tensors (never views of a model): cast floats to the run's dtype
        # as the model is cast, without a second copy when it is already that dtype. A lifted
        # constant (``torch.tensor(2.5)``, made in forward at torch's default dtype) is no part
        # of the model, which ``model.to(dtype)`` leaves it out of: it keeps its traced dtype,
        # as on one device (DeBERTa-v2's relative-position buckets: a float32 constant widened
        # to float64 computes neither the model's float32 value nor a float64 one)
        if value.is_floating_point() and name not in constants:
            value = value.to(dtype=dtype)
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


def _write_state_in_child(model_path: str | Path, seed: int, path: Path) -> None:
    """Build the seeded model and write its state in a child process, which exits and frees
    the model before this rank goes on (a fresh interpreter: nothing of the rank's memory, and
    the user's own script is not imported again)."""
    code = ("import sys; from ssdsl.runtime.init import _write_state_main; "
            "_write_state_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code, str(model_path), str(seed), str(path)],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0 or not path.exists():
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"writing the initial state of {model_path} failed in a child "
                           f"process (exit status {done.returncode}): {tail}")


def _write_state_main(model_path: str, seed: int, path: str) -> None:
    from ssdsl.trace.model_file import load_model_file
    write_state(load_model_file(model_path).build(seed=seed), path)


# How long the other local ranks wait for local rank 0's file (a large model's state takes minutes
# to build and write; the collective timeout, a bound on a peer that stopped answering, is not it).
INIT_WAIT_VAR = "SSDSL_INIT_TIMEOUT_S"
DEFAULT_INIT_WAIT_S = 3600.0
_INIT_POLL_S = 0.05


def _init_wait_s() -> float:
    value = os.environ.get(INIT_WAIT_VAR)
    try:
        return float(value) if value else DEFAULT_INIT_WAIT_S
    except ValueError:
        raise RuntimeError(f"{INIT_WAIT_VAR}={value!r} is not a number of seconds") from None


def _wait_for_state(path: Path, failed: Path, wait_s: float) -> None:
    """Until local rank 0 has put ``path`` in place, or said in ``failed`` why it could not."""
    import time
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if failed.exists():
            raise RuntimeError("local rank 0 could not write the initial state: "
                               + failed.read_text(errors="replace").strip())
        if time.monotonic() > deadline:
            raise RuntimeError(f"local rank 0 did not write the initial state {path} within "
                               f"{wait_s:g} s (set {INIT_WAIT_VAR} for a larger model)")
        time.sleep(_INIT_POLL_S)


def shared_state_file(model_file: Any, *, seed: int, local_rank: int, barrier,
                      key: str) -> StateFile:
    """Under torchrun: local rank 0 writes the seeded model's state to a machine-local file,
    every local rank opens it. ``key`` names the job (same on all ranks).

    The wait for the file is not a collective: writing a large model's state can outlast the
    collective timeout, which bounds a peer that stopped answering, not this. Rank 0 clears a
    stale file of the same name before the first ``barrier()`` (all ranks come to it straight
    from planning, the same work on each) and has it written (``write_state`` renames a whole
    file into place); the others poll for the name (or for the reason rank 0 failed) up to
    ``$SSDSL_INIT_TIMEOUT_S``. The second ``barrier()`` is when everyone has it open."""
    digest = hashlib.sha1(f"{key}:{seed}:{model_file.path}".encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"ssdsl-init-{digest}.pt"
    failed = path.with_name(path.name + ".failed")
    if local_rank == 0:
        for stale in (path, failed):
            with contextlib.suppress(OSError):
                stale.unlink()
    barrier()
    if local_rank == 0:
        try:
            _write_state_in_child(model_file.path, seed, path)  # renamed into place whole
        except BaseException as exc:
            with contextlib.suppress(OSError):  # whole, as the state file: never read half
                said = failed.with_name(failed.name + ".tmp")
                said.write_text(f"{type(exc).__name__}: {exc}")
                os.replace(said, failed)
            raise
    else:
        _wait_for_state(path, failed, _init_wait_s())
    state = StateFile(path)
    barrier()  # everyone has it open: the name can go (an open file keeps its data)
    if local_rank == 0:
        with contextlib.suppress(OSError):
            path.unlink()
    return state
