"""The ranks' fork server: a forked rank is the process a spawned one was, in every way a worker
or the launcher can see, and the server never serves a job whose environment it did not load in.

Oracles: what the launcher asked for (its working directory, the job's environment and thread
count, its standard output), and the process tree read from /proc and ``os``, not from the
server's own bookkeeping.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from ssdsl.runtime import forkserver
from ssdsl.runtime.launch import RankFailed, launch

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------ workers (run in the ranks)

def describe_rank(tag: str) -> dict:
    import torch

    from ssdsl.runtime import prebuilt
    print(f"rank {os.environ['RANK']} says {tag}", flush=True)
    return {"pid": os.getpid(), "parent": os.getppid(), "cwd": os.getcwd(),
            "threads": torch.get_num_threads(), "rank": int(os.environ["RANK"]),
            "leader": os.getpgrp() == os.getpid() == os.getsid(0),
            "extra": os.environ.get("SSDSL_TEST_EXTRA"),
            # read by ssdsl when the module is imported: a server loaded in another
            # environment would show its value
            "check_bindings": prebuilt.CHECK_BINDINGS,
            "name": Path("/proc/self/comm").read_text().strip()}


def kill_my_parent_then_wait() -> None:
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)  # the kernel ends this rank first (PR_SET_PDEATHSIG)


# ----------------------------------------------------------------------------------- tests

def test_forked_ranks_are_their_own_processes_in_the_launchers_directory(tmp_path, monkeypatch,
                                                                          capfd):
    monkeypatch.chdir(tmp_path)
    first = launch(describe_rank, nproc=2, args=("hello",), env={"OMP_NUM_THREADS": "1"})
    again = launch(describe_rank, nproc=2, args=("again",), env={"OMP_NUM_THREADS": "2"})
    out = capfd.readouterr().out
    for tag in ("hello", "again"):
        for rank in (0, 1):
            assert f"rank {rank} says {tag}" in out
    server = forkserver._SERVER[0].proc.pid
    for results, threads in ((first, 1), (again, 2)):
        assert [r["rank"] for r in results] == [0, 1]
        for r in results:
            assert r["parent"] == server != os.getpid()
            assert r["cwd"] == str(tmp_path)
            assert r["threads"] == threads
            assert r["leader"]
            assert r["name"] == f"ssdsl rank {r['rank']}"
    pids = {r["pid"] for r in first + again}
    assert len(pids) == 4 and os.getpid() not in pids
    for pid in pids:  # every rank was reaped
        assert not Path(f"/proc/{pid}").exists()


def test_a_job_in_another_environment_gets_a_server_started_in_it(monkeypatch):
    launch(describe_rank, nproc=1, args=("warm",))
    before = forkserver._SERVER[0].proc.pid
    monkeypatch.setenv("SSDSL_CHECK_BINDINGS", "1")
    monkeypatch.setenv("SSDSL_TEST_EXTRA", "seen")
    (r,) = launch(describe_rank, nproc=1, args=("other",))
    assert r["check_bindings"] is True and r["extra"] == "seen"
    assert r["parent"] == forkserver._SERVER[0].proc.pid != before
    assert not Path(f"/proc/{before}").exists() or \
        Path(f"/proc/{before}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    monkeypatch.delenv("SSDSL_CHECK_BINDINGS")
    monkeypatch.delenv("SSDSL_TEST_EXTRA")
    (r,) = launch(describe_rank, nproc=1, args=("back",))
    assert r["check_bindings"] is False and r["extra"] is None


def test_without_the_server_ranks_are_the_launchers_children(monkeypatch):
    monkeypatch.setenv(forkserver.SERVER_VAR, "0")
    results = launch(describe_rank, nproc=2, args=("spawned",))
    assert [r["parent"] for r in results] == [os.getpid()] * 2
    assert [r["name"] for r in results] == ["ssdsl rank 0", "ssdsl rank 1"]


def test_a_rank_dies_with_its_server_and_the_job_says_so():
    with pytest.raises(RankFailed) as err:
        launch(kill_my_parent_then_wait, nproc=2, timeout_s=50)
    assert "SIGKILL" in str(err.value)
    # the next job starts a new server
    assert [r["rank"] for r in launch(describe_rank, nproc=2, args=("after",))] == [0, 1]


def _launch_in_a_forked_launcher(queue) -> None:
    results = launch(describe_rank, nproc=1, args=("child launcher",))
    queue.put((os.getpid(), results[0]["parent"], forkserver._SERVER[0].proc.pid))


def test_a_process_forked_from_the_launcher_starts_its_own_server():
    """A launcher forked (``multiprocessing``'s fork context) holds its parent's handle: it must
    neither talk on the parent's socket nor close the parent's server at its exit."""
    import multiprocessing

    launch(describe_rank, nproc=1, args=("parent",))
    parent_server = forkserver._SERVER[0].proc.pid
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_launch_in_a_forked_launcher, args=(queue,))
    child.start()
    pid, rank_parent, child_server = queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    assert rank_parent == child_server != parent_server
    # the parent's server still serves, and is the same process
    (r,) = launch(describe_rank, nproc=1, args=("parent again",))
    assert r["parent"] == parent_server == forkserver._SERVER[0].proc.pid


def which_ssdsl() -> tuple[int, str]:
    import ssdsl
    return os.getppid(), str(Path(ssdsl.__file__).resolve())


def test_the_server_imports_the_launchers_ssdsl_wherever_it_starts(tmp_path, monkeypatch):
    """A server started in a directory holding another ``ssdsl`` (a checkout beside an installed
    one) still loads the launcher's: its ranks run the code the launcher planned with."""
    import ssdsl
    decoy = tmp_path / "ssdsl"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy ssdsl was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSDSL_TEST_EXTRA", "a server of its own, started here")
    ((parent, where),) = launch(which_ssdsl, nproc=1)
    assert parent == forkserver._SERVER[0].proc.pid != os.getpid()
    assert where == str(Path(ssdsl.__file__).resolve())


def test_a_spawned_rank_imports_the_launchers_ssdsl_too(tmp_path, monkeypatch):
    import ssdsl
    decoy = tmp_path / "ssdsl"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy ssdsl was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(forkserver.SERVER_VAR, "0")
    ((parent, where),) = launch(which_ssdsl, nproc=1)
    assert parent == os.getpid()
    assert where == str(Path(ssdsl.__file__).resolve())
