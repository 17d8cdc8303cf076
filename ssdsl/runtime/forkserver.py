"""A fork server: one process that has imported torch and ssdsl once, and forks the ranks.

A rank started as a fresh interpreter spends seconds before it runs a line of its worker: the
imports of Python, torch and ssdsl (3.8 s measured on this project's 2-core machine), then
``torch._dynamo``'s, which the first ``Optimizer.add_param_group`` pulls in (1.7 s), in every rank
of every job. ``launch`` asks this server instead: it is started once per launcher process (at
the launcher's first job, or ahead of it with ``prestart()``: ``ssdsl run`` starts it before it
traces, so its imports run beside the trace), imports what a rank needs, runs no operator and
starts no thread, and then answers each request with ``os.fork()``. A forked rank is a process
of its own, exactly as ``launch`` describes a rank: it leads a session of its own, gets the
rank's environment, working directory, standard output and error (the launcher's, passed with
each request), sets its compute threads from ``OMP_NUM_THREADS`` (OpenMP read the variable once,
when the server loaded torch), and runs ``ssdsl.runtime.launch._rank_main``; it dies with the
server, which dies with the launcher (``PR_SET_PDEATHSIG``). The server reports each rank's exit
status, as a parent does (a negative status: killed by that signal), so the launcher watches a
forked rank as it watches a spawned one (``ForkedRank`` has ``subprocess.Popen``'s ``pid``,
``poll``, ``wait`` and ``returncode``).

A server serves one environment: the launcher's when it started, apart from what ``launch`` sets
per job and per rank (``PER_JOB_VARS``). Modules may read the environment when they are
imported, so a job whose environment differs otherwise replaces the server with one started in
the new environment. ``SSDSL_FORK_SERVER=0`` turns the server off (every rank a fresh
interpreter, as before), as does a platform other than Linux.

The protocol: a Unix socket pair of datagrams (``SOCK_SEQPACKET``), pickled tuples. The server
sends ``("ready", ssdsl file, python)`` once, then ``("pid", pid)`` for each ``("fork", env,
cwd)`` request (which carries the launcher's standard output and error as file descriptors) and
``("exit", pid, status)`` when a rank it forked ends.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SERVER_VAR = "SSDSL_FORK_SERVER"  # 0: no fork server
_SOCKET_VAR = "SSDSL_FORK_SERVER_FD"
_READY_S = 180.0  # a server that has not loaded by then is given up (the ranks are spawned)
_REAP_S = 0.01    # how often the server looks for ranks that ended while any runs

# What ``launch`` sets for each job and rank: the server's environment may differ in these
PER_JOB_VARS = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK",
    "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "SSDSL_LAUNCH_DIR", "SSDSL_LAUNCHER_PID",
    "SSDSL_RANK_CPUS", "SSDSL_HOST_CPUS", "SSDSL_DIST_TIMEOUT_S", "SSDSL_SHM_JOB", SERVER_VAR,
    _SOCKET_VAR,
})


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return sys.platform.startswith("linux") and env.get(SERVER_VAR, "1") != "0"


def home() -> str:
    """The folder this process imports ssdsl from: a server or rank puts it first on its path,
    so that it runs the launcher's ssdsl wherever its working directory would find another (a
    checkout's ``ssdsl/`` beside an installed one)."""
    import ssdsl
    return str(Path(ssdsl.__file__).resolve().parent.parent)


def _base(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_JOB_VARS}


class ForkServer:
    """The launcher's handle on one server process (see the module doc)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.base = _base(env)
        server_env = dict(env)
        server_env[_SOCKET_VAR] = str(theirs.fileno())
        server_env["SSDSL_LAUNCHER_PID"] = str(os.getpid())
        code = (f"import sys; sys.path.insert(0, {home()!r}); "
                "from ssdsl.runtime.forkserver import _serve; _serve()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=server_env,
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        theirs.close()
        self.sock = ours
        self.owner = os.getpid()  # a process forked from the launcher must not use it
        self.lock = threading.Lock()
        self.ready: tuple | None = None
        self.dead = False
        self.exits: dict[int, int] = {}
        self.live: set[int] = set()

    # -- messages

    def _handle(self, msg: tuple) -> tuple | None:
        if msg[0] == "exit":
            self.exits[msg[1]] = msg[2]
            self.live.discard(msg[1])
            return None
        if msg[0] == "ready":
            self.ready = msg
            return None
        return msg

    def _read(self, timeout: float | None) -> tuple | None:
        """One message (an answer, not an exit notice) within ``timeout`` seconds, handling the
        notices that come before it; None when none came (or the server is gone)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.dead:
            left = None if end is None else max(0.0, end - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                return None
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # the server died: its ranks died with it (PR_SET_PDEATHSIG)
                self.dead = True
                for pid in self.live:
                    self.exits.setdefault(pid, -signal.SIGKILL)
                self.live.clear()
                return None
            answer = self._handle(pickle.loads(data))
            if answer is not None:
                return answer
        return None

    def pump(self) -> None:
        """Take in the exit notices that have come."""
        with self.lock:
            self._read(0.0)

    def wait_ready(self, timeout: float = _READY_S) -> bool:
        end = time.monotonic() + timeout
        with self.lock:
            while self.ready is None and not self.dead and time.monotonic() < end:
                self._read(min(0.5, max(0.0, end - time.monotonic())))
                if self.ready is None and self.proc.poll() is not None:
                    self.dead = True
        return self.ready is not None and not self.dead

    def usable(self, env: Mapping[str, str]) -> bool:
        """Whether this server may fork a rank of a job with environment ``env``."""
        if self.dead or self.proc.poll() is not None or _base(env) != self.base:
            return False
        if not self.wait_ready():
            return False
        import ssdsl
        return self.ready[1:] == (str(Path(ssdsl.__file__).resolve()), sys.executable)

    def fork(self, env: Mapping[str, str]) -> ForkedRank | None:
        """A rank forked with environment ``env`` in this process's working directory, writing
        to this process's standard output and error; None when the server could not."""
        with self.lock:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            msg = pickle.dumps(("fork", dict(env), os.getcwd()))
            try:
                socket.send_fds(self.sock, [msg], [_fd(sys.stdout, 1), _fd(sys.stderr, 2)])
            except OSError:
                self.dead = True
                return None
            answer = self._read(30.0)
            if answer is None or answer[0] != "pid":
                return None
            self.live.add(answer[1])
            return ForkedRank(self, answer[1])

    def close(self) -> None:
        if self.owner != os.getpid():  # the launcher's server, seen from a process it forked
            return
        self.dead = True
        try:
            self.sock.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _fd(stream: Any, default: int) -> int:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (captured)
        return default


class ForkedRank:
    """A rank the server forked, watched as a ``subprocess.Popen`` is."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.pid not in self.server.exits:
                self.server.pump()
            if self.pid in self.server.exits:
                self.returncode = self.server.exits.pop(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode


# ------------------------------------------------------------------ the launcher's server

_SERVER: list[ForkServer] = []
_SERVER_LOCK = threading.Lock()


def server_for(env: Mapping[str, str]) -> ForkServer | None:
    """The server that forks the ranks of a job whose environment is ``env`` (started, or
    replaced, as needed), or None: ranks are then spawned as fresh interpreters."""
    if not enabled(env):
        return None
    with _SERVER_LOCK:
        server = _SERVER[0] if _SERVER else None
        if server is not None and server.owner != os.getpid():
            _SERVER.clear()  # inherited through a fork of the launcher: its parent's to use
            server = None
        if server is not None and server.usable(env):
            return server
        if server is not None:
            server.close()
            _SERVER.clear()
        server = _start(env)
        return server if server is not None and server.usable(env) else None


def prestart(env: Mapping[str, str] | None = None) -> None:
    """Start the server now, so that its imports run while this process does other work."""
    env = dict(os.environ if env is None else env)
    if not enabled(env):
        return
    with _SERVER_LOCK:
        if not _SERVER or _SERVER[0].owner != os.getpid():
            _start(env)


def _start(env: Mapping[str, str]) -> ForkServer | None:
    try:
        server = ForkServer(env)
    except OSError:
        return None
    _SERVER[:] = [server]
    return server


@atexit.register
def _close_at_exit() -> None:
    for server in _SERVER:
        server.close()  # (not a server this process did not start)
    _SERVER.clear()


# ------------------------------------------------------------------------- the server itself


def _serve() -> None:
    """The server's main loop (the module doc)."""
    sock = socket.socket(fileno=int(os.environ.pop(_SOCKET_VAR)))
    from ssdsl.runtime.launch import _die_with_launcher
    _die_with_launcher(int(os.environ["SSDSL_LAUNCHER_PID"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    _preload()
    import ssdsl
    sock.send(pickle.dumps(("ready", str(Path(ssdsl.__file__).resolve()), sys.executable)))
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], _REAP_S if children else None)
        _reap(sock, children)
        if not ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        except OSError:
            msg = b""
        if not msg:  # the launcher closed its end: nothing more to do
            os._exit(0)
        _, env, cwd = pickle.loads(msg)
        pid = os.fork()
        if pid == 0:
            _child(sock, fds, env, cwd)  # never returns
        for fd in fds:
            os.close(fd)
        children.add(pid)
        sock.send(pickle.dumps(("pid", pid)))


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            sock.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status))))


def _preload() -> None:
    """What every rank imports: torch, its distributed package, ssdsl's runtime and planning,
    and ``torch._dynamo`` (which an optimizer's first ``add_param_group`` imports)."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import ssdsl.runtime.job  # noqa: F401
    import ssdsl.runtime.launch  # noqa: F401


def _child(sock: socket.socket, fds: list[int], env: dict[str, str], cwd: str) -> None:
    code = 1
    try:
        server = os.getppid()
        sock.close()
        os.setsid()  # a session (and process group) of its own, as a spawned rank
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for target, fd in zip((1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        os.environ["SSDSL_LAUNCHER_PID"] = str(server)  # its parent: it dies with the server
        from ssdsl.runtime.launch import _rank_main
        _rank_main(forked=True)
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happens, this process must not go back
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
