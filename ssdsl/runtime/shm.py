"""Point-to-point messages between CPU ranks of one host through shared memory.

Gloo moves a message between two processes of one host over a loopback TCP connection: the
sender's ``isend`` hands it to gloo's threads, which write it through the kernel's TCP stack,
and the receiver's threads read it back out. Measured on this project's 2-core machine
(``bench/bench_p2p.py``: one 128 KiB tensor passed back and forth between two ranks, torch
2.13): 417-630 us of CPU time a message on each side and 942 us from send to receipt. A
pipeline's middle rank sends and receives 16 such messages a step on the peers' GPT at 4
micro-batches, several ms of CPU that ranks sharing cores pay in time.

Here a message goes through a *slot*: a file in ``/dev/shm`` that both ranks map (torch's
``from_file(shared=True)``). The sender copies the tensor into a free slot of its size and
writes a 24-byte record to a FIFO that the receiver reads; the receiver copies the slot out
into its buffer and writes back a record that frees the slot. Measured the same way: 43-65 us
of CPU a message on each side, 94 us from send to receipt. A send never waits for the
receiver: it takes a free slot, or maps a new one when every slot of that size is still
unread (as many slots as messages in flight: one or two on a 1F1B boundary, not one per
micro-batch).

One FIFO per ordered pair of ranks carries both kinds of record from its writer to its reader:
``DATA`` (a message for this tag is in that slot) and ``FREE`` (the slot you filled is read).
Every record is written whole (24 bytes, under the pipe's atomic size) and the pipe is
enlarged where the host allows, so that a rank that sends many messages before its peer reads
any does not block on a full pipe. A message of a tag that arrives before its receive is
posted waits in order (gloo's matching by peer and tag, first in first out). The copy into the
slot happens before the record is written and the copy out after it is read: both are system
calls, which order the memory between the processes on every architecture.

Which pairs: ``SameHost.create`` (collective, from ``ProcessGroups.create``) has every rank put
a probe file in ``/dev/shm`` and says which other ranks' probes it sees; a pair talks through
shared memory only where both see each other's (one host, one ``/dev/shm``: not two containers
with separate ones) and both sides made their FIFO. Only CPU tensors go this way (a GPU's go
through its backend). The all-reduces by pairwise exchanges (``ssdsl.runtime.exchange``) send
through the same channels, each process group's messages under a tag of its own (``route``);
gloo's own collectives stay gloo's. Every file is unlinked as soon as both ranks hold it open,
so nothing is left in ``/dev/shm`` after a run; a slot a killed rank had not yet handed over is
removed by ``ssdsl.runtime.launch`` once the ranks are gone (``sweep``: the files of one launch
share a prefix). Under torchrun nothing sweeps.

``ENABLED = False``, or ``SSDSL_SHM=0`` in the environment, sends everything through gloo
(benchmarks compare).
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import struct
import uuid
from typing import Any

import torch
import torch.distributed as dist

# False: every message goes through gloo (benchmarks compare)
ENABLED = True
# where the slots and FIFOs live (a tmpfs on Linux)
DIRECTORY = "/dev/shm"
# the pipe size asked for (Linux's default ceiling for an unprivileged process, 43,690 records)
PIPE_BYTES = 1 << 20
# how long a receive waits for its message before it says so (a peer that died)
TIMEOUT_S = 1800.0

# set by ``ssdsl.runtime.launch`` for the ranks of one launch: every file of their channels
# starts with ``ssdsl-JOB-``, which the launcher sweeps once the ranks are gone (``sweep``)
JOB_VAR = "SSDSL_SHM_JOB"

_RECORD = struct.Struct("qqq")  # kind, tag, slot
_DATA, _FREE = 1, 2
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Python 3.10+ names it; Linux only)


def sweep(job: str) -> int:
    """Remove what the ranks of launch ``job`` left in ``DIRECTORY`` (a slot a killed rank had
    not yet handed over); how many files."""
    if not job or not os.path.isdir(DIRECTORY):
        return 0
    n = 0
    for name in os.listdir(DIRECTORY):
        if name.startswith(f"ssdsl-{job}-"):
            try:
                os.unlink(os.path.join(DIRECTORY, name))
                n += 1
            except OSError:
                pass
    return n


def wanted() -> bool:
    """Whether this process may use shared memory for its messages at all."""
    return ENABLED and os.environ.get("SSDSL_SHM", "1").strip() != "0" \
        and os.path.isdir(DIRECTORY) and hasattr(os, "mkfifo")


class _Peer:
    """This rank's side of the two FIFOs and the slots shared with one other rank."""

    __slots__ = ("rank", "out_fd", "in_fd", "prefix_out", "prefix_in", "slots", "sizes", "free",
                 "mapped", "arrived", "got", "posted", "leftover")

    def __init__(self, rank: int, out_fd: int, in_fd: int, prefix_out: str, prefix_in: str):
        self.rank, self.out_fd, self.in_fd = rank, out_fd, in_fd
        self.prefix_out, self.prefix_in = prefix_out, prefix_in
        self.slots: list[torch.Tensor] = []  # slots this rank sends through (its own, mapped)
        self.sizes: list[int] = []  # the message bytes each of those serves
        self.free: dict[int, list[int]] = collections.defaultdict(list)  # nbytes -> slot ids
        self.mapped: dict[int, torch.Tensor] = {}  # slots this rank receives through
        # per tag: messages arrived and receives posted so far; the n-th receive posted for a
        # tag takes the n-th message of that tag (gloo's matching), in ``got`` by (tag, n)
        self.arrived: dict[int, int] = collections.defaultdict(int)
        self.posted: dict[int, int] = collections.defaultdict(int)
        self.got: dict[tuple[int, int], int] = {}
        self.leftover = b""


class SameHost:
    """Shared-memory messages with the ranks of this host (see the module docstring)."""

    def __init__(self, rank: int, peers: dict[int, _Peer], base: str = "") -> None:
        self.rank = rank
        self.peers = peers
        self.base = base  # the path every file of this job's channels starts with
        self.counts = {"sent": 0, "received": 0, "slots": 0}

    # -- setup (collective) ------------------------------------------------------------------
    @classmethod
    def create(cls) -> SameHost | None:
        """Every rank calls it at the same point (it is collective on the default group); the
        ranks this one shares a host and ``/dev/shm`` with, or None where there are none (or
        ``wanted`` is False on any rank: every rank then decides alike)."""
        from ssdsl.runtime.dist import all_gather_objects
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        token = uuid.uuid4().hex[:16]
        backend = str(dist.get_backend())
        mine = (wanted() and "gloo" in backend, token)
        gathered = all_gather_objects(mine)
        if not all(ok for ok, _ in gathered):
            return None
        job = os.environ.get(JOB_VAR, "")
        base = os.path.join(DIRECTORY, f"ssdsl-{job + '-' if job else ''}{gathered[0][1]}")
        probe = f"{base}-probe-{rank}"
        made: list[str] = []
        try:
            with open(probe, "w"):
                made.append(probe)
        except OSError:
            pass
        dist.barrier()
        seen = {r for r in range(world) if r != rank and os.path.exists(f"{base}-probe-{r}")}
        views = all_gather_objects(sorted(seen))
        local = sorted(r for r in seen if rank in views[r])
        peers: dict[int, _Peer] = {}
        ok = True
        try:
            for r in local:
                out_path, in_path = f"{base}-fifo-{rank}-{r}", f"{base}-fifo-{r}-{rank}"
                for path in (out_path, in_path):
                    try:
                        os.mkfifo(path, 0o600)
                        made.append(path)
                    except FileExistsError:
                        pass
                # read and write: opening a FIFO so never waits for the other end (Linux)
                out_fd = os.open(out_path, os.O_RDWR)
                in_fd = os.open(in_path, os.O_RDWR | os.O_NONBLOCK)
                for fd in (out_fd, in_fd):
                    try:
                        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
                    except OSError:
                        pass  # the default (64 KiB, 2,730 records)
                peers[r] = _Peer(r, out_fd, in_fd, f"{base}-slot-{rank}-{r}",
                                 f"{base}-slot-{r}-{rank}")
        except OSError:
            ok = False
        agreed = all(all_gather_objects(ok))  # both ends open on every rank, or no one uses it
        for path in made:  # both ends hold them open now: the names can go
            try:
                os.unlink(path)
            except OSError:
                pass
        if not agreed or not peers:
            for p in peers.values():
                os.close(p.out_fd)
                os.close(p.in_fd)
            return None
        return cls(rank, peers, base)

    def close(self) -> None:
        for p in self.peers.values():
            for fd in (p.out_fd, p.in_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.peers = {}

    # -- messages ----------------------------------------------------------------------------
    def handles(self, peer: int, t: torch.Tensor) -> bool:
        """Whether a message of ``t`` to or from ``peer`` goes through shared memory."""
        return peer in self.peers and t.device.type == "cpu"

    def send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        """Copy ``t`` into a free slot and tell ``peer``: the send is complete on return."""
        p = self.peers[peer]
        nbytes = t.numel() * t.element_size()
        self._pump(p, block=False)  # slots the peer has read since
        free = p.free[nbytes]
        if free:
            slot = free.pop()
        else:
            slot = len(p.slots)
            path = f"{p.prefix_out}-{slot}"
            p.slots.append(torch.from_file(path, shared=True, size=max(nbytes, 1),
                                           dtype=torch.uint8))
            p.sizes.append(nbytes)
            self.counts["slots"] += 1
        buf = p.slots[slot]
        if nbytes:
            buf[:nbytes].view(t.dtype).view(t.shape).copy_(t)
        self._write(p, _DATA, tag, slot)
        self.counts["sent"] += 1

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        """Wait for ``peer``'s message of ``tag`` and copy it into ``buf`` (returned)."""
        return self.irecv(buf, peer, tag).wait_for()

    def irecv(self, buf: torch.Tensor, peer: int, tag: int) -> _Receive:
        """A receive to ``wait()`` for later: it takes the next message of ``tag`` from
        ``peer`` that no receive posted before it takes, as gloo's would (nothing is copied
        until then: the message waits in its slot)."""
        p = self.peers[peer]
        n = p.posted[tag]
        p.posted[tag] = n + 1
        return _Receive(self, buf, peer, tag, n)

    def _take(self, buf: torch.Tensor, peer: int, tag: int, n: int) -> torch.Tensor:
        p = self.peers[peer]
        while (tag, n) not in p.got:
            self._pump(p, block=True)
        slot = p.got.pop((tag, n))
        nbytes = buf.numel() * buf.element_size()
        src = p.mapped.get(slot)
        if src is None:
            path = f"{p.prefix_in}-{slot}"
            src = p.mapped[slot] = torch.from_file(path, shared=True, size=max(nbytes, 1),
                                                   dtype=torch.uint8)
            os.unlink(path)  # both ends map it now
        if nbytes:
            if src.numel() < nbytes:
                raise RuntimeError(f"rank {self.rank}: the message of tag {tag} from rank "
                                   f"{peer} holds {src.numel()} bytes, not {nbytes}")
            buf.copy_(src[:nbytes].view(buf.dtype).view(buf.shape))
        self._write(p, _FREE, tag, slot)
        self.counts["received"] += 1
        return buf

    # -- the FIFOs ---------------------------------------------------------------------------
    def _write(self, p: _Peer, kind: int, tag: int, slot: int) -> None:
        os.write(p.out_fd, _RECORD.pack(kind, tag, slot))  # blocking, whole (under PIPE_BUF)

    def _pump(self, p: _Peer, *, block: bool) -> None:
        """Read every record the peer wrote so far (with ``block``, wait for one at least)."""
        if block:
            waiting = select.poll()  # not select(): a busy process's fds pass FD_SETSIZE
            waiting.register(p.in_fd, select.POLLIN)
            if not waiting.poll(TIMEOUT_S * 1000):
                raise TimeoutError(f"rank {self.rank} waited {TIMEOUT_S:.0f} s for a message "
                                   f"from rank {p.rank}")
        try:
            data = os.read(p.in_fd, 1 << 16)
        except BlockingIOError:
            return
        data = p.leftover + data
        whole = len(data) - len(data) % _RECORD.size
        p.leftover = data[whole:]
        for kind, tag, slot in _RECORD.iter_unpack(data[:whole]):
            if kind == _DATA:
                n = p.arrived[tag]
                p.arrived[tag] = n + 1
                p.got[(tag, n)] = slot
            else:
                p.free[p.sizes[slot]].append(slot)


class _Receive:
    """A receive from shared memory, waited for later (``SameHost.irecv``)."""

    __slots__ = ("host", "buf", "peer", "tag", "n", "done")

    def __init__(self, host: SameHost, buf: torch.Tensor, peer: int, tag: int, n: int) -> None:
        self.host, self.buf, self.peer, self.tag, self.n = host, buf, peer, tag, n
        self.done = False

    def wait(self) -> bool:
        self.wait_for()
        return True

    def wait_for(self) -> torch.Tensor:
        if not self.done:
            self.host._take(self.buf, self.peer, self.tag, self.n)
            self.done = True
        return self.buf

    def is_completed(self) -> bool:
        return self.done


# process group (the default one as ``dist.group.WORLD``) -> (the ``SameHost`` its members'
# messages go through, the group's number): ``ProcessGroups.create`` registers its groups, in
# the same order on every rank, so that the all-reduces by exchanges (``ssdsl.runtime.exchange``)
# send through shared memory too, each group's messages under a tag of its own (gloo keeps each
# group's messages apart; one FIFO per pair of ranks must not mix two groups' exchanges)
_ROUTES: dict[Any, tuple[SameHost, int]] = {}


def register(group: Any, host: SameHost, number: int) -> None:
    _ROUTES[group if group is not None else dist.group.WORLD] = (host, number)


def forget() -> None:
    """Close every channel registered in this process (its process groups are going away)."""
    for host in {id(h): h for h, _ in _ROUTES.values()}.values():
        host.close()
    _ROUTES.clear()


def route(group: Any) -> tuple[SameHost, int] | None:
    """The ``SameHost`` and number of ``group`` (None: the default group), or None."""
    return _ROUTES.get(group if group is not None else dist.group.WORLD)
