"""A training job (`ssdsl run`) whose rank stops answering ends within 30 s, naming that rank.

The ranks are found from /proc (the children of the `ssdsl run` process), not from the
launcher's bookkeeping; the rank that is stopped (SIGSTOP) or that sleeps in its model file's
get_batch is chosen here, and the message must name it. No rank outlives the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BOUND_S = 30.0

# Small and fast: thousands of steps, so the job is surely in training when a rank is stopped.
# Rank SLEEPY (if set) sleeps in get_batch at step 3, as a rank stuck reading its data would.
MODEL = textwrap.dedent('''
    import os, time, torch
    from torch import nn

    BATCH_SIZE = 4

    def build_model():
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))

    def get_batch(step, batch_size):
        if step == 3 and os.environ.get("RANK") == os.environ.get("SLEEPY"):
            time.sleep(3600)  # the line the message must show
        if step == 3 and os.environ.get("RANK") == os.environ.get("GREEDY"):
            import re  # a backtracking match: seconds in C, holding the GIL all along
            re.match(r"(a+)+$", "a" * 27 + "b")
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 3, generator=g), torch.randint(0, 2, (batch_size,), generator=g)
''')


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (a rank may be a child of the launcher's fork server)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *_children(kid)]
    return out


def _rank_of(pid: int) -> int | None:
    """The rank a process is, by the name the launcher gives it, or by its environment."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if name.startswith("ssdsl rank "):
        return int(name.rsplit(" ", 1)[1])
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(tmp_path: Path, **env: str) -> subprocess.Popen:
    model = tmp_path / "small.py"
    model.write_text(MODEL)
    return subprocess.Popen(
        [sys.executable, "-m", "ssdsl", "run", str(model), "dp", "--world", "2",
         "--steps", "100000", "--no-verify", "--timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env})


def _wait_for_training(proc: subprocess.Popen) -> tuple[list[str], dict[int, int]]:
    """Read the output up to the first step line; the ranks' pids by rank."""
    seen = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("step "):
            break
    assert seen and seen[-1].startswith("step "), "".join(seen)
    ranks = {_rank_of(p): p for p in _children(proc.pid)}
    ranks.pop(None, None)
    assert sorted(ranks) == [0, 1], (ranks, "".join(seen))
    return seen, ranks


def _finish(proc: subprocess.Popen, pids: list[int]) -> str:
    try:
        rest, _ = proc.communicate(timeout=BOUND_S + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:  # never leave a stopped process behind, whatever happened
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    return rest


@pytest.mark.parametrize("victim", [1, 0])
def test_a_stopped_rank_ends_the_job_and_is_named(tmp_path, victim):
    proc = _start(tmp_path)
    seen, ranks = _wait_for_training(proc)
    os.kill(ranks[victim], signal.SIGSTOP)
    stopped_at = time.monotonic()
    end = stopped_at + BOUND_S
    while proc.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    elapsed = time.monotonic() - stopped_at
    print(f"job ended {elapsed:.1f} s after rank {victim} was stopped")
    alive_after = [p for p in ranks.values() if _alive(p)]
    out = "".join(seen) + _finish(proc, list(ranks.values()))
    assert elapsed < BOUND_S, out[-3000:]
    assert proc.returncode not in (0, None), out[-3000:]
    assert f"rank {victim} failed: stopped answering" in out, out[-3000:]
    assert "Traceback" not in out
    time.sleep(1.0)
    assert not [p for p in alive_after if _alive(p)], "rank processes outlived the job"


def test_a_rank_asleep_in_get_batch_is_named_with_its_line(tmp_path):
    proc = _start(tmp_path, SLEEPY="1", SSDSL_HANG_S="8")
    seen, ranks = _wait_for_training(proc)
    start = time.monotonic()
    end = start + BOUND_S
    while proc.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    print(f"job ended {elapsed:.1f} s after its first step")
    out = "".join(seen) + _finish(proc, list(ranks.values()))
    assert elapsed < BOUND_S, out[-3000:]
    assert proc.returncode not in (0, None), out[-3000:]
    assert "rank 1 failed: never came to the communication" in out, out[-3000:]
    # rank 0 waits in the gradients' all-reduce (on gloo by exchanges: named as the collective,
    # not as the exchange's helper it blocks in)
    assert " s in all_reduce, while rank 1 is" in out, out[-3000:]
    line = MODEL.splitlines().index(next(x for x in MODEL.splitlines() if "3600" in x)) + 1
    assert f"small.py:{line} in get_batch" in out, out[-3000:]
    assert "Traceback" not in out
    time.sleep(1.0)
    assert not [p for p in ranks.values() if _alive(p)], "rank processes outlived the job"


def test_a_rank_that_computes_while_its_heartbeat_is_starved_is_not_stopped(tmp_path):
    """Rank 1 spends seconds (4-9 s) in one native call that holds the GIL (its heartbeat thread
    cannot write), with the stale bound asked at 1 s (the launcher keeps it at two beats, 2 s,
    so that rank 0's next beat, a moment late on a loaded machine, is not taken for silence; it
    once was, in CI): it uses the CPU, so the watchdog leaves it be and the
    job finishes (before, it was named 'stopped answering', as a transformers import on a
    loaded machine once was)."""
    model = tmp_path / "small.py"
    model.write_text(MODEL)
    out = subprocess.run(
        [sys.executable, "-m", "ssdsl", "run", str(model), "dp", "--world", "2", "--steps", "6",
         "--no-verify", "--timeout", "300"], capture_output=True, text=True, cwd=tmp_path,
        timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                          "GREEDY": "1", "SSDSL_STALE_S": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "stopped answering" not in out.stdout + out.stderr


def test_runnable_tells_a_computing_process_from_a_sleeping_or_stopped_one():
    """The watchdog's second sign of life, checked against processes whose state is known: a
    shell loop that spins is runnable; a sleep and a SIGSTOPped spinner are not."""
    from ssdsl.runtime.launch import _runnable

    spin = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    nap = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        assert any(_runnable(spin.pid) for _ in range(20))
        assert not _runnable(nap.pid)
        os.kill(spin.pid, signal.SIGSTOP)
        time.sleep(0.3)
        assert not _runnable(spin.pid)
    finally:
        for p in (spin, nap):
            p.kill()
            p.wait()
