"""Start N local ranks, collect what each returns, and end the whole job when one of them fails.

``launch(worker, nproc=N, args=...)`` runs ``worker(*args, **kwargs)`` in N processes of their own
(forked by ``ssdsl.runtime.forkserver``, which has imported torch and ssdsl once; with
``SSDSL_FORK_SERVER=0``, fresh interpreters) that rendezvous on loopback (env:// with ``MASTER_ADDR=127.0.0.1``; the launcher hosts the store on
a port the OS picks, as torchrun's agent does, so two jobs never race for a port). It returns the N
return values in rank order. A worker learns its rank from the environment
(``ssdsl.runtime.dist.RankEnv.from_environ()``), exactly as under torchrun, so the same worker runs
under ``torchrun`` too: there the caller checks ``under_torchrun()`` and calls
``resolve_worker(worker)(*args)`` in-process instead of launching.

Failure handling, the point of this module:

- a rank that raises, exits non-zero, or is killed by a signal ends the job: every other rank is
  sent SIGTERM, then SIGKILL after ``grace_s``; ``launch`` raises ``RankFailed`` naming the rank
  that caused it, with its error text (and its traceback as the ``__cause__``, for ``--debug``);
- a rank that hangs is named by the watchdog: every rank writes a heartbeat each second (from a
  thread: whether its main thread waits in communication, how many communication calls it has
  made, and where its own code is). A rank whose heartbeat stops (SIGSTOP, a frozen process) is
  named after ``stale_s``, unless its process is using the CPU (its heartbeat thread is starved
  by a native call that holds the GIL: it works); a rank that does not come to a communication its peers have waited in
  for ``hang_s`` without progress (asleep in ``get_batch``, say) is named with the line it is at.
  Both well before gloo's collective timeout (``ssdsl.runtime.dist``), which stays as a backstop,
  as does ``timeout_s`` for the whole job (``JobTimeout``);
- no orphans: each rank leads its own process group (killed as a group, so its children go too, and
  a Ctrl-C reaching the launcher kills them all), and asks the kernel to SIGKILL it if the launcher
  itself dies (``PR_SET_PDEATHSIG``).

Each rank is pinned to cores of its own where the ranks and their compute threads fit the cores
the launcher may use (``rank_cpus``): rank ``r`` gets the ``r``-th run of ``OMP_NUM_THREADS`` of
them. Left to the scheduler, two one-thread ranks on this 2-core machine moved between the cores
and made a tiny GPT's ``dp`` step 1.2-1.3 times as long (DDP's and ssdsl's alike). Where the ranks
oversubscribe the cores, or ``SSDSL_PIN=0``, nothing is pinned.

Workers can stream small records (per-step metrics) to the launcher with ``report_event(obj)``;
``launch(..., on_event=fn)`` calls ``fn(rank, obj)`` in the launcher as they arrive.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ssdsl.errors import SsdslError
from ssdsl.runtime import forkserver
from ssdsl.runtime.dist import TIMEOUT_VAR

Worker = str | Callable[..., Any]
EventHandler = Callable[[int, Any], None]

_POLL_S = 0.02
# After the first failure, wait this long for other ranks to fail too, so the report can name the
# rank that caused it (an exception) rather than a peer that only saw its socket close.
_SETTLE_S = 0.5
_LAUNCH_DIR_VAR = "SSDSL_LAUNCH_DIR"
_PIN_VAR = "SSDSL_PIN"  # 0: ranks are not pinned to cores
_RANK_CPUS_VAR = "SSDSL_RANK_CPUS"  # the CPUs a rank pins itself to, comma-separated
# the CPUs the launcher may use: a pinned rank's helper threads may run on any of them
_HOST_CPUS_VAR = "SSDSL_HOST_CPUS"
_LAUNCHER_PID_VAR = "SSDSL_LAUNCHER_PID"
# The watchdog: a heartbeat per rank each _BEAT_S; a rank silent for STALE_S is stopped or frozen;
# peers waiting HANG_S in communication, without a new call, for a rank that is elsewhere and has
# neither moved from its line nor used the CPU for HANG_S (asleep, or blocked on something
# else), name it.
# Both can be set in the environment (a model whose steps take longer than HANG_S on one rank while
# another waits needs a larger value).
_BEAT_S = 1.0
_BUSY_CPU_S = 0.05  # CPU seconds between two beats that show a rank computing, not standing still
STALE_S = float(os.environ.get("SSDSL_STALE_S", "10"))
# A beat is due every _BEAT_S: a bound under two periods would name a rank whose next beat is
# merely a moment late (it did, now and then, on a loaded machine with SSDSL_STALE_S=1)
_MIN_STALE_S = 2 * _BEAT_S
HANG_S = float(os.environ.get("SSDSL_HANG_S", "15"))


class LaunchError(SsdslError):
    """A launched job could not start or did not finish."""


class WorkerNotFound(LaunchError):
    """A ``module:function`` worker name that does not resolve to a callable."""


class RankFailed(LaunchError):
    """A rank raised, exited with an error, or was killed; the job was ended because of it."""

    def __init__(self, failure: RankFailure, *, others: Sequence[RankFailure] = (),
                 still_running: Sequence[int] = ()) -> None:
        self.failure = failure
        self.others = tuple(others)
        self.still_running = tuple(still_running)
        super().__init__(f"rank {failure.rank} failed: {_clean(failure.summary)}",
                         hint=_failure_hint(failure, self.others, self.still_running))
        self.rank = failure.rank
        if failure.traceback:
            self.__cause__ = RemoteTraceback(failure.rank, failure.traceback)


class RankHung(RankFailed):
    """The watchdog found a rank that stopped answering, or that its peers wait for in vain."""


class JobTimeout(LaunchError):
    """The job ran past the launcher's ``timeout_s``; all ranks were ended."""


class RemoteTraceback(Exception):
    """A rank's traceback, chained under ``RankFailed`` so that ``--debug`` shows where it failed."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"traceback of rank {rank}:\n{text}")


@attrs.frozen
class RankFailure:
    """How one rank failed. ``kind``: ``exception``, ``signal`` or ``exit``; ``at``: wall time."""

    rank: int
    kind: str
    summary: str
    traceback: str = ""
    at: float = 0.0

    @property
    def is_consequence(self) -> bool:
        """A communication error seen because some *other* rank died or stopped answering."""
        return self.kind == "exception" and bool(_PEER_FAULT.search(self.summary))


# Messages gloo, nccl and the TCP store give when a peer is gone or silent; they blame the wrong rank.
_PEER_FAULT = re.compile(r"Connection (closed|reset) by peer|Broken pipe|[Tt]imed? ?out|"
                         r"DistNetworkError|DistBackendError|ECONNRESET|EPIPE|"
                         r"Socket Timeout|NCCL communicator was aborted")


def _failure_hint(failure: RankFailure, others: Sequence[RankFailure],
                  still_running: Sequence[int]) -> str | None:
    notes = []
    if others:
        notes.append("then " + ", ".join(f"rank {o.rank} ({_short(o.summary)})" for o in others))
    if still_running:
        notes.append(f"rank{'s' if len(still_running) > 1 else ''} "
                     f"{', '.join(map(str, still_running))} did not finish and "
                     f"{'were' if len(still_running) > 1 else 'was'} stopped "
                     "(a rank that stops answering makes its peers time out)")
    if failure.traceback:
        notes.append("run with --debug for the rank's traceback")
    return "; ".join(notes) or None


def _clean(summary: str) -> str:
    """The message without the C++ source location gloo puts in front of it."""
    return re.sub(r"\[[^\]\n]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", summary)


def _short(summary: str) -> str:
    line = _clean(summary).splitlines()[0] if summary else ""
    return line if len(line) <= 100 else line[:97] + "..."


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process is already one rank of a job (torchrun, or a rank ``launch`` started).

    The caller then runs the worker in-process instead of launching processes of its own.
    """
    env = os.environ if environ is None else environ
    return all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))


def resolve_worker(worker: Worker) -> Callable[..., Any]:
    """The callable named by ``"package.module:function"``, or ``worker`` itself if callable."""
    if callable(worker):
        return worker
    module_name, sep, attr = worker.partition(":")
    if not sep or not module_name or not attr:
        raise WorkerNotFound(f"worker {worker!r} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise WorkerNotFound(f"cannot find worker {worker!r}: {exc}") from exc
    if not callable(obj):
        raise WorkerNotFound(f"worker {worker!r} is not callable")
    return obj


_local_handler: EventHandler | None = None


def set_local_event_handler(handler: EventHandler | None) -> None:
    """Where ``report_event`` sends records when this process was not started by ``launch``
    (under torchrun, say, rank 0 can feed its own ``ssdsl.runtime.progress`` view)."""
    global _local_handler
    _local_handler = handler


def report_event(obj: Any) -> None:
    """Send a small picklable record to the launcher's ``on_event`` (or the local handler)."""
    launch_dir = os.environ.get(_LAUNCH_DIR_VAR)
    if not launch_dir:
        if _local_handler is not None:
            _local_handler(int(os.environ.get("RANK", "0")), obj)
        return
    data = pickle.dumps(obj)
    path = Path(launch_dir) / f"rank{os.environ['RANK']}.events"
    # One write per record under O_APPEND: the launcher never sees a record cut by a second writer.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, struct.pack("<I", len(data)) + data)
    finally:
        os.close(fd)


def launch(worker: Worker, *, nproc: int, args: Sequence[Any] = (),
           kwargs: Mapping[str, Any] | None = None, timeout_s: float | None = None,
           grace_s: float = 3.0, on_event: EventHandler | None = None,
           env: Mapping[str, str] | None = None,
           dist_timeout_s: float | None = None,
           poll: Callable[[], None] | None = None) -> list[Any]:
    """Run ``worker(*args, **kwargs)`` on ``nproc`` local ranks; their return values in rank order.

    ``worker`` is ``"module:function"`` or a picklable callable (a module-level function); args,
    kwargs and the return value must pickle. ``env`` adds variables to the ranks' environment.
    ``dist_timeout_s`` becomes the ranks' default collective timeout (``ssdsl.runtime.dist``).
    ``poll`` is called in this process between looks at the ranks (first in each): what it
    raises stops the ranks and is raised here (``ssdsl run`` verifies meanwhile, in a thread).
    Raises ``RankFailed`` when a rank fails and ``JobTimeout`` after ``timeout_s`` seconds.

    Example::

        losses = launch("mypkg.train:worker", nproc=4, args=("model.py",), timeout_s=600)
    """
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, not {nproc}")
    if isinstance(worker, str):
        resolve_worker(worker)  # fail in the launcher, once, rather than in every rank
    # Two layers: the rank must set sys.path before it can unpickle a worker defined in, say, a
    # test module that is importable only through the launcher's path.
    call = pickle.dumps((worker, tuple(args), dict(kwargs or {})))
    payload = pickle.dumps({"sys_path": list(sys.path), "call": call})
    with tempfile.TemporaryDirectory(prefix="ssdsl-launch-") as tmp:
        job = _Job(Path(tmp), nproc=nproc, grace_s=grace_s, on_event=on_event, poll=poll)
        (job.dir / "payload.pkl").write_bytes(payload)
        store = _host_store()
        extra = dict(env or {})
        if dist_timeout_s is not None:
            extra[TIMEOUT_VAR] = str(dist_timeout_s)
        from ssdsl.runtime import shm
        shm_job = extra.setdefault(shm.JOB_VAR, uuid.uuid4().hex[:12])
        try:
            job.start(_rank_env(extra, nproc=nproc, port=store.port, launch_dir=job.dir))
            return job.wait(timeout_s)
        finally:
            job.kill_all()
            shm.sweep(shm_job)  # what a killed rank left in /dev/shm
            del store


def _host_store() -> Any:
    """A TCP store on a port the OS picks; the ranks join it as clients (torchrun's agent store)."""
    from torch.distributed import TCPStore  # torch is heavy; only the launcher needs it here

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _rank_env(extra: Mapping[str, str] | None, *, nproc: int, port: int,
              launch_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True",
        _LAUNCH_DIR_VAR: str(launch_dir), _LAUNCHER_PID_VAR: str(os.getpid()),
    })
    env["OMP_NUM_THREADS"] = str(rank_threads(nproc, env))
    return env


def rank_threads(nproc: int, env: Mapping[str, str] | None = None) -> int:
    """The compute threads each of ``nproc`` launched ranks uses: ``OMP_NUM_THREADS`` where
    ``env`` (this process's environment) sets it, else the usable cores shared out, at least
    one: N ranks each using every core oversubscribe the CPU badly; torchrun makes the same
    choice."""
    got = (os.environ if env is None else env).get("OMP_NUM_THREADS")
    if got is not None:
        try:
            return max(1, int(got))
        except ValueError:
            pass
    return max(1, len(_usable_cpus()) // nproc)


def _usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_cpus(rank: int, nproc: int, threads: int, cpus: Sequence[int]) -> tuple[int, ...] | None:
    """The CPUs rank ``rank`` of ``nproc`` is pinned to, each rank using ``threads`` compute
    threads, on a host whose usable CPUs are ``cpus``: the ``rank``-th run of ``threads`` of
    them, or None (not pinned) where the ranks would not each have cores of their own.

    >>> rank_cpus(1, 2, 1, [0, 1]), rank_cpus(1, 2, 2, [0, 1, 2, 3]), rank_cpus(0, 4, 1, [0, 1])
    ((1,), (2, 3), None)
    """
    if threads < 1 or nproc * threads > len(cpus):
        return None
    return tuple(cpus[rank * threads:(rank + 1) * threads])


def _pins(env: Mapping[str, str], nproc: int) -> list[tuple[int, ...] | None]:
    """Each rank's CPUs under ``env`` (``SSDSL_PIN=0``: none pinned)."""
    if env.get(_PIN_VAR, "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return [None] * nproc
    try:
        threads = int(env.get("OMP_NUM_THREADS", "1"))
    except ValueError:
        return [None] * nproc
    cpus = _usable_cpus()
    return [rank_cpus(r, nproc, threads, cpus) for r in range(nproc)]


class _Job:
    """The launcher's mutable view of the running ranks (lives only inside ``launch``)."""

    def __init__(self, directory: Path, *, nproc: int, grace_s: float,
                 on_event: EventHandler | None, poll: Callable[[], None] | None = None) -> None:
        self.dir = directory
        self.poll = poll
        self.nproc = nproc
        self.grace_s = grace_s
        self.on_event = on_event
        self.procs: list[subprocess.Popen | forkserver.ForkedRank] = []
        self.event_offsets = [0] * nproc
        self.killed_by_us: set[int] = set()
        self.next_watch = 0.0
        self.cpu_seen: dict[int, float | None] = {}

    def start(self, env: dict[str, str]) -> None:
        # the launcher's ssdsl, not one the working directory holds (``forkserver.home``)
        code = (f"import sys; sys.path.insert(0, {forkserver.home()!r}); "
                "from ssdsl.runtime.launch import _rank_main; _rank_main()")
        pins = _pins(env, self.nproc)
        server = forkserver.server_for(env)
        for rank in range(self.nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            for var in (_RANK_CPUS_VAR, _HOST_CPUS_VAR):  # a launcher that is itself a rank
                rank_env.pop(var, None)
            if pins[rank] is not None:
                rank_env[_RANK_CPUS_VAR] = ",".join(map(str, pins[rank]))
                rank_env[_HOST_CPUS_VAR] = ",".join(map(str, _usable_cpus()))
            # forked by the server, which has imported torch and ssdsl once (``forkserver``)
            forked = server.fork(rank_env) if server is not None else None
            if forked is not None:
                self.procs.append(forked)
                continue
            # A session of its own: Ctrl-C reaches only the launcher, which then ends the ranks.
            self.procs.append(subprocess.Popen([sys.executable, "-c", code], env=rank_env,
                                               stdin=subprocess.DEVNULL,
                                               start_new_session=True))

    def wait(self, timeout_s: float | None) -> list[Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.poll is not None:
                self.poll()
            self.pump_events()
            codes = [p.poll() for p in self.procs]
            if any(c not in (None, 0) for c in codes):
                self.fail()
            if all(c == 0 for c in codes):
                self.pump_events()
                return [self.result(rank) for rank in range(self.nproc)]
            self.watch(codes)
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                self.kill_all()
                raise JobTimeout(f"the job ran past its time limit of {timeout_s:g} s; "
                                 f"rank{'s' if len(running) > 1 else ''} "
                                 f"{', '.join(map(str, running))} still running were stopped")
            time.sleep(_POLL_S)

    def fail(self) -> None:
        """Let the failure settle, stop the rest, and raise ``RankFailed`` for the likeliest cause."""
        settle_end = time.monotonic() + _SETTLE_S
        while time.monotonic() < settle_end and any(p.poll() is None for p in self.procs):
            time.sleep(_POLL_S)
        running = [r for r, p in enumerate(self.procs) if p.poll() is None]
        self.pump_events()
        self.kill_all()
        failures = [f for r in range(self.nproc) if r not in running
                    for f in [self.failure(r)] if f is not None]
        # The cause: a rank whose fault is its own (not a peer's socket error), earliest first.
        failures.sort(key=lambda f: (f.is_consequence, f.at, f.rank))
        raise RankFailed(failures[0], others=failures[1:], still_running=running)

    def watch(self, codes: list[int | None]) -> None:
        """Raise ``RankHung`` for a rank the heartbeats show stopped, or waited for in vain."""
        now = time.time()
        if now < self.next_watch:
            return
        self.next_watch = now + _BEAT_S / 2
        beats = {r: _read_beat(self.dir, r) for r, c in enumerate(codes) if c is None}
        if any(b is None for b in beats.values()):
            return  # a rank still starting (its first beat comes within a second of its start)
        busy = self.busy(beats)
        bound = max(STALE_S, _MIN_STALE_S)
        stale = [r for r, b in beats.items() if now - b.at > bound and r not in busy]
        # every rank silent at once is the whole machine paused, unless some rank has finished
        # since: the silent one stopped on its own (a destructor that blocks as the worker
        # returns, holding the interpreter: its heartbeat thread cannot run either)
        done = [r for r, c in enumerate(codes) if c == 0]
        if stale and (len(stale) < len(beats) or done):
            r = stale[0]
            after = (f" after rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} "
                     "finished" if done and len(stale) == len(beats) else "")
            self.hang(r, f"stopped answering{after}: no heartbeat for "
                         f"{now - beats[r].at:.0f} s (the process is stopped, e.g. by SIGSTOP, "
                         f"frozen, or blocked in native code that holds the interpreter, such as "
                         f"a process group's destructor as the worker returns); it was "
                         f"{beats[r].describe()}", beats)
        waiting = {r: b for r, b in beats.items() if b.waiting_since is not None
                   and now - b.waiting_since > HANG_S}
        absent = [r for r, b in beats.items() if b.waiting_since is None
                  and now - b.still_since > HANG_S]
        if waiting and absent:
            r = absent[0]
            longest = max(now - b.waiting_since for b in waiting.values())
            who = ", ".join(map(str, sorted(waiting)))
            self.hang(r, f"never came to the communication its peers wait for: rank"
                         f"{'s' if len(waiting) > 1 else ''} {who} waited {longest:.0f} s in "
                         f"{waiting[min(waiting)].op}, while rank {r} is {beats[r].describe()}",
                      beats)

    def busy(self, ranks) -> set[int]:
        """The ``ranks`` whose process used the CPU since the last look, or has a thread waiting
        for a CPU, and is not stopped: their heartbeat thread may be starved (a long native call
        holding the GIL, an import on a loaded machine, more runnable threads than cores), but
        they work. Unknown (no ``/proc``): not busy."""
        now = {r: _process_cpu_s(self.procs[r].pid) for r in ranks}
        busy = {r for r, cpu in now.items() if cpu is not None
                and ((self.cpu_seen.get(r) is not None and cpu - self.cpu_seen[r] > _BUSY_CPU_S)
                     or _runnable(self.procs[r].pid))}
        self.cpu_seen.update(now)
        return busy

    def hang(self, rank: int, summary: str, beats: dict[int, Any]) -> None:
        others = [r for r in beats if r != rank]
        self.kill_all()
        raise RankHung(RankFailure(rank, "hang", summary, at=time.time()), still_running=others)

    def failure(self, rank: int) -> RankFailure | None:
        code = self.procs[rank].returncode
        outcome = self._outcome(rank)
        if outcome is not None and outcome[0] == "error":
            _, summary, tb, at = outcome
            return RankFailure(rank, "exception", summary, tb, at)
        if code == 0:
            return None
        if code < 0:
            return RankFailure(rank, "signal", f"killed by signal {_signal_name(-code)}",
                               at=time.time())
        return RankFailure(rank, "exit", f"exited with status {code}", at=time.time())

    def result(self, rank: int) -> Any:
        outcome = self._outcome(rank)
        if outcome is None:
            raise RankFailed(RankFailure(rank, "exit", "exited without returning a result "
                                         "(did the worker call sys.exit(0) or os._exit?)"))
        if outcome[0] == "error":
            raise RankFailed(RankFailure(rank, "exception", outcome[1], outcome[2], outcome[3]))
        return outcome[1]

    def _outcome(self, rank: int) -> tuple | None:
        path = self.dir / f"rank{rank}.result"
        return pickle.loads(path.read_bytes()) if path.exists() else None

    def pump_events(self) -> None:
        if self.on_event is None:
            return
        for rank in range(self.nproc):
            path = self.dir / f"rank{rank}.events"
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.event_offsets[rank])
                data = f.read()
            used = 0
            while len(data) - used >= 4:
                (size,) = struct.unpack_from("<I", data, used)
                if len(data) - used - 4 < size:
                    break  # the rest of this record is still being written
                self.on_event(rank, pickle.loads(data[used + 4:used + 4 + size]))
                used += 4 + size
            self.event_offsets[rank] += used

    def kill_all(self) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is left after the grace."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
            # a stopped rank (SIGSTOP) acts on SIGTERM only once it runs again, so it is
            # continued: it then ends now rather than after the grace
            _signal_group(p, signal.SIGCONT)
        end = time.monotonic() + self.grace_s
        while time.monotonic() < end and any(p.poll() is None for p in live):
            time.sleep(_POLL_S)
        for p in self.procs:
            # Also the groups of ranks that already exited: a child they forked may linger.
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- inside a rank


def _rank_main(*, forked: bool = False) -> None:
    """Entry point of a launched rank: run the worker, write its outcome, exit. ``forked``: the
    fork server's child, whose torch was loaded before ``OMP_NUM_THREADS`` was this rank's."""
    _die_with_launcher(int(os.environ[_LAUNCHER_PID_VAR]))
    cpus = os.environ.get(_RANK_CPUS_VAR)
    if cpus:  # before torch starts its threads, which inherit it
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if forked:
        _threads_from_environ()
    _name_process(f"ssdsl rank {os.environ.get('RANK', '?')}")
    launch_dir = Path(os.environ[_LAUNCH_DIR_VAR])
    rank = int(os.environ["RANK"])
    _start_heartbeat(launch_dir, rank)
    outcome = _run_payload(launch_dir / "payload.pkl")
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:
        outcome = _error_outcome(TypeError(f"the worker's return value does not pickle: {exc}"))
        data = pickle.dumps(outcome)
    tmp = launch_dir / f"rank{rank}.result.tmp"
    tmp.write_bytes(data)
    tmp.rename(launch_dir / f"rank{rank}.result")  # atomic: the launcher never reads half a file
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destructors of a process group whose peers died can block.
    os._exit(0 if outcome[0] == "ok" else 1)


def _name_process(name: str) -> None:
    """Give this process a name ``ps``, ``top`` and ``/proc/PID/comm`` show (Linux: 15 bytes):
    a forked rank's command line is its server's, and its ``/proc/PID/environ`` the server's
    environment as it started."""
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


def _threads_from_environ() -> None:
    """Compute threads as ``OMP_NUM_THREADS`` says, as a fresh interpreter's torch would set
    them (OpenMP reads the variable once, when it is loaded)."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return
    if threads >= 1:
        import torch
        torch.set_num_threads(threads)


def _run_payload(path: Path) -> tuple:
    try:
        payload = pickle.loads(path.read_bytes())
        sys.path[:] = payload["sys_path"]
        worker, args, kwargs = pickle.loads(payload["call"])
        return ("ok", resolve_worker(worker)(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - a rank reports every failure, even SystemExit
        return _error_outcome(exc)


def _error_outcome(exc: BaseException) -> tuple:
    if isinstance(exc, SsdslError):
        summary = exc.render()
    else:
        summary = f"{type(exc).__name__}: {exc}"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ("error", summary, tb, time.time())


def _die_with_launcher(launcher_pid: int) -> None:
    """Ask Linux to SIGKILL this rank when the launcher dies, so no rank outlives it."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher_pid:  # the launcher died before the request took effect
        os._exit(1)


# ----------------------------------------------------------------------------- the watchdog


@attrs.frozen
class _Beat:
    """One heartbeat: when, since when the main thread waits in communication (None: it does
    not), the communication it waits in, the rank's own code line it is at, and since when it
    has been at that line (a rank that is slow but busy moves; a hung one does not)."""

    at: float
    waiting_since: float | None
    op: str
    where: str
    still_since: float = 0.0  # since when the main thread has been at this same line

    def describe(self) -> str:
        if self.waiting_since is not None:
            return f"waiting in {self.op} (at {self.where})"
        return f"at {self.where}" if self.where else "running"


def _read_beat(directory: Path, rank: int) -> _Beat | None:
    try:
        return pickle.loads((directory / f"rank{rank}.beat").read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


_COMM_CALLS = [0]  # communication calls this rank has made (a wait is "new" when this grows)
_COMM_FUNCS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "send",
               "recv", "isend", "irecv", "barrier", "batch_isend_irecv", "all_gather_object",
               "gather_object", "broadcast_object_list", "gather", "scatter", "reduce",
               "init_process_group", "monitored_barrier")


def _count_comm_calls() -> None:
    """Wrap torch.distributed's communication functions to count calls (looked up at call time by
    ``dist.all_reduce(...)``, so every caller is counted)."""
    import functools

    import torch.distributed as tdist

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            _COMM_CALLS[0] += 1
            return fn(*args, **kwargs)
        return call

    for name in _COMM_FUNCS:
        fn = getattr(tdist, name, None)
        if callable(fn) and not getattr(fn, "_ssdsl_counted", False):
            wrapped = counted(fn)
            wrapped._ssdsl_counted = True  # type: ignore[attr-defined]
            setattr(tdist, name, wrapped)
    # torch tells a point-to-point op's kind by identity (``op.op is isend``): a P2POp made of
    # the counting wrappers gets the functions they wrap (batch_isend_irecv itself is counted)
    if not getattr(tdist.P2POp, "_ssdsl_counted", False):
        class P2POp(tdist.P2POp):
            _ssdsl_counted = True

            def __new__(cls, op: Any, *args: Any, **kwargs: Any) -> Any:
                return super().__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)

            def __init__(self, op: Any, *args: Any, **kwargs: Any) -> None:
                super().__init__(getattr(op, "__wrapped__", op), *args, **kwargs)

        P2POp.__qualname__ = P2POp.__name__ = "P2POp"
        P2POp.__module__ = tdist.P2POp.__module__
        tdist.P2POp = P2POp


def _process_cpu_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (``/proc/PID/stat``); None when it is stopped
    (SIGSTOP, a debugger), a zombie, or the system has no ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("T", "t", "Z", "X"):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _runnable(pid: int) -> bool:
    """Whether a thread of process ``pid`` is running or waiting for a CPU (state R in
    ``/proc/PID/task/*/stat``): such a process is neither stopped nor frozen."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "R":
                return True
        except (OSError, IndexError):
            continue
    return False


def _start_heartbeat(directory: Path, rank: int, *, period_s: float = _BEAT_S,
                     count_comm: bool = True) -> None:
    """A daemon thread that writes this rank's ``_Beat`` every ``period_s`` seconds."""
    import threading

    main = threading.main_thread().ident

    def beat() -> None:
        since, calls, still, last = None, -1, time.time(), None
        cpu = time.process_time()
        path, tmp = directory / f"rank{rank}.beat", directory / f"rank{rank}.beat.tmp"
        while True:
            # The main thread's frames are looked at and let go at once: a frame held across
            # the sleep keeps its locals alive, and a fake tensor of a torch.export trace kept
            # so turns up as a lifted constant ("fake tensor in the exported program
            # constant's list"; it failed a rank's trace now and then)
            op, where = _inspect_stack(sys._current_frames().get(main))
            now, cpu_now = time.time(), time.process_time()
            if op is None:
                since = None
            elif since is None or calls != _COMM_CALLS[0]:
                since = now
            calls = _COMM_CALLS[0]
            # a rank that computes has moved on, even inside one long call (a torch.export
            # trace at one line of the model's code, on a loaded machine): only a rank that
            # neither changes its line nor uses the CPU is standing still (asleep, blocked)
            if (op, where) != last or cpu_now - cpu > _BUSY_CPU_S:
                still, last = now, (op, where)
            cpu = cpu_now
            try:
                tmp.write_bytes(pickle.dumps(_Beat(now, since, op or "", where, still)))
                tmp.rename(path)
            except OSError:  # the launcher removed its directory: the job is over
                return
            time.sleep(period_s)

    threading.Thread(target=beat, name="ssdsl-heartbeat", daemon=True).start()
    if not count_comm:
        return
    try:  # after the first beat is on its way: importing torch takes a while
        _count_comm_calls()
    except Exception:  # pragma: no cover - a rank without torch.distributed has no waits to watch
        pass


_OWN_FILES = ("/torch/", "/ssdsl/runtime/launch.py", "/threading.py", "/contextlib.py")
# ssdsl's own communication code: a main thread in it waits in a collective (the all-reduce by
# exchanges waits inside torch's ``Work.wait``, a native call that leaves no frame of torch's)
_COMM_FILES = ("/ssdsl/runtime/comm.py", "/ssdsl/runtime/exchange.py", "/ssdsl/runtime/shm.py")


def _inspect_stack(frame: Any) -> tuple[str | None, str]:
    """(the communication the main thread waits in, or None; the innermost line of code that is
    neither torch's nor the launcher's, as ``file:line in function``)."""
    op, where = None, ""
    while frame is not None:
        code = frame.f_code
        name = code.co_filename.replace("\\", "/")
        if name.endswith("/exchange.py"):
            # the exchange's helpers (``_swap_add``, ``wait``), and the shared-memory receive
            # they wait in, are an all-reduce to the user
            op = "all_reduce"
        elif op is None and ("/torch/distributed/" in name or name.endswith(_COMM_FILES)):
            # a receive through shared memory (``shm._take``, ``_pump``) is a receive
            op = "recv" if name.endswith("/shm.py") else code.co_name
        if not where and not any(part in name for part in _OWN_FILES):
            where = f"{Path(name).name}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return op, where
