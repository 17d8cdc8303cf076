"""Process-group setup for one rank: rendezvous from the environment, device, teardown.

Every rank, whether started by ``ssdsl.runtime.launch`` or by ``torchrun``, finds its place in the
job in the same environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so a worker written against this module runs unchanged on one machine or many.

The process group gets a bounded timeout: a peer that stops answering makes the collectives of the
other ranks raise after ``timeout_s`` instead of blocking forever, and the launcher then ends the job.

Usage::

    with distributed(timeout_s=60) as ctx:
        x = torch.ones(2, device=ctx.device)
        dist.all_reduce(x)
        losses = all_gather_objects(loss.item())    # one entry per rank, in rank order
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ssdsl.errors import SsdslError

# Long enough for a slow first step (allocation, lazy init) on a loaded CI machine, short enough
# that a dead peer is reported within a minute rather than gloo's default half hour.
DEFAULT_TIMEOUT_S = 60.0
# The launcher passes its ``dist_timeout_s`` to the ranks through this variable.
TIMEOUT_VAR = "SSDSL_DIST_TIMEOUT_S"


class DistEnvError(SsdslError):
    """The rendezvous variables (RANK, WORLD_SIZE, ...) are missing or inconsistent."""


@attrs.frozen
class RankEnv:
    """Where this process sits in the job, as the launcher or torchrun wrote it in the env."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """Read the variables; raise ``DistEnvError`` naming the one that is missing or wrong."""
        env = os.environ if environ is None else environ
        values = {name: _int_var(env, name) for name in ("RANK", "WORLD_SIZE")}
        rank, world = values["RANK"], values["WORLD_SIZE"]
        local_rank = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = (_int_var(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env
                       else world)
        if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
            raise DistEnvError(f"inconsistent rendezvous variables: RANK={rank} "
                               f"WORLD_SIZE={world} LOCAL_RANK={local_rank} "
                               f"LOCAL_WORLD_SIZE={local_world}")
        return cls(rank, world, local_rank, local_world)


def _int_var(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise DistEnvError(f"environment variable {name} is not set",
                           hint="start ranks with `ssdsl run --nproc N` or with torchrun")
    try:
        return int(env[name])
    except ValueError:
        raise DistEnvError(f"environment variable {name}={env[name]!r} is not an integer") from None


@attrs.frozen
class DistContext:
    """This rank's view of an initialised job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_backend() -> str:
    """``nccl`` when CUDA is usable, ``gloo`` otherwise (every test here runs gloo on the CPU)."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def pick_device(local_rank: int, backend: str) -> torch.device:
    """One GPU per local rank under nccl; the CPU under gloo."""
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DistEnvError(f"local rank {local_rank} has no GPU: this machine has {count}",
                               hint="start at most one rank per GPU on each machine")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def default_timeout_s() -> float:
    """``$SSDSL_DIST_TIMEOUT_S`` when the launcher set it, else ``DEFAULT_TIMEOUT_S``."""
    value = os.environ.get(TIMEOUT_VAR)
    try:
        return float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise DistEnvError(f"{TIMEOUT_VAR}={value!r} is not a number of seconds") from None


def init_from_env(*, timeout_s: float | None = None, backend: str | None = None) -> DistContext:
    """Join the job described by the environment (env:// rendezvous) and return this rank's context.

    ``timeout_s`` (default: ``default_timeout_s()``) bounds the rendezvous and every later
    collective: a peer that never arrives or stops answering makes this rank raise instead of wait.
    """
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    where = RankEnv.from_environ()
    backend = backend or pick_backend()
    device = pick_device(where.local_rank, backend)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device  # eager NCCL init: a bad GPU fails here, not mid-step
        dist.init_process_group(backend=backend, init_method="env://", rank=where.rank,
                                world_size=where.world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistContext(rank=where.rank, world_size=where.world_size,
                       local_rank=where.local_rank, backend=backend, device=device)


def teardown() -> None:
    """Destroy the process group if one exists (safe to call twice, or after a failure), and
    close the shared-memory channels made with it (``ssdsl.runtime.shm``)."""
    from ssdsl.runtime import shm
    shm.forget()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def distributed(*, timeout_s: float | None = None, backend: str | None = None
                ) -> Iterator[DistContext]:
    """``init_from_env`` on entry, ``teardown`` on exit, also when the body raises."""
    ctx = init_from_env(timeout_s=timeout_s, backend=backend)
    try:
        yield ctx
    finally:
        teardown()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, small: losses, metrics, results), in rank order, on all ranks."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj: Any, *, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank ``dst``; ``None`` on the others."""
    is_dst = dist.get_rank() == dst
    out: list[Any] | None = [None] * dist.get_world_size() if is_dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def broadcast_object(obj: Any = None, *, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the others pass anything, usually nothing)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
