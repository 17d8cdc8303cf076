"""Sends issued by a thread of their own (the distributed executor only).

On gloo a send whose receive the peer has posted already (``ssdsl.runtime.early`` posts them a
unit ahead) writes its bytes into the socket right inside ``isend``, in the calling thread: the
rank's compute waits for the copy, and on a loaded machine for the peer's side of the socket.
``Sender`` hands each send to one thread per process, which issues the ``isend``; the rank goes
on at once (torch's calls release the GIL while they compute, so the thread runs meanwhile).
``wait`` is ``wait_sends``: every send handed over issued, then each completed.

What meets what is unchanged: a message is matched by its (peer, tag), unique in a program, so
when its send is issued does not matter; every send is issued and complete by ``WaitSends``,
where the program waits for them.

A message to a CPU rank of the same host goes through shared memory instead
(``ssdsl.runtime.shm``: a copy into a slot and a record in a FIFO, complete on return), never
through this thread: the thread carries the sends that gloo moves.
"""

from __future__ import annotations

import os
import queue
import threading

import torch
import torch.distributed as dist

from ssdsl.runtime.host import own_cores, pinned_host_cpus

# False issues each send in the rank's own thread (``ssdsl.runtime.comm.isend``; benchmarks
# compare)
ENABLED = True
# True uses the thread even where the ranks of this host already fill its cores (tests)
ALWAYS = False


def wanted() -> bool:
    """Whether this rank's sends go through a sender thread: where the ranks on this host and
    their compute threads leave it a core. Where they fill the cores already (4 ranks of one
    thread on 2 cores), one more runnable thread a process only adds switches: measured on the
    peers' 1f1b at 4 ranks on 2 cores, fresh launches, 3 rounds, the thread made the step
    1.055 times as long; at 2 ranks of one thread on 2 cores it shortens it. A rank the
    launcher pinned to its own cores (``ssdsl.runtime.launch.rank_cpus``) counts the host's
    cores, on any of which the thread runs (it widens its own affinity)."""
    if not ENABLED:
        return False
    return ALWAYS or own_cores()


class Sender:
    """One thread that issues this process's sends, in the order they are handed over."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._issued: list[tuple[object, torch.Tensor]] = []
        self._error: BaseException | None = None
        self._pending = 0  # handed over and not issued yet
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ssdsl-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        host = pinned_host_cpus()
        if host and hasattr(os, "sched_setaffinity"):  # this thread only (Linux: pid 0)
            try:
                os.sched_setaffinity(0, host)
            except OSError:
                pass
        while True:
            piece, peer, tag = self._todo.get()
            try:
                req = dist.isend(piece, peer, tag=tag)
            except BaseException as err:  # noqa: BLE001 - raised again by ``wait``
                req = None
                self._error = err
            with self._done:
                if req is not None:
                    self._issued.append((req, piece))
                self._pending -= 1
                self._done.notify_all()

    def post(self, piece: torch.Tensor, peer: int, tag: int) -> None:
        """Send ``piece`` (kept alive until ``wait``) to ``peer`` under ``tag``, without
        blocking."""
        with self._done:
            self._pending += 1
        self._todo.put((piece, peer, tag))

    def wait(self) -> int:
        """Wait until every send handed over was issued and has completed; how many there
        were."""
        with self._done:
            while self._pending:
                self._done.wait()
            issued, self._issued = self._issued, []
        error, self._error = self._error, None
        for req, _piece in issued:
            req.wait()
        if error is not None:
            raise error
        return len(issued)


_SENDER: dict[int, Sender] = {}  # process id -> its sender (a forked child starts its own)


def sender() -> Sender:
    """This process's sender (started on first use)."""
    pid = os.getpid()
    found = _SENDER.get(pid)
    if found is None:
        _SENDER.clear()
        found = _SENDER[pid] = Sender()
    return found
