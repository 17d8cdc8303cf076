"""A rank that trains keeps the host memory one step freed for the next (``ssdsl.runtime.hostmem``).

The oracle is the kernel's count of minor page faults (``getrusage``), not anything hostmem
computes: a step whose tensors reuse memory the process kept faults no page in. The steps before
``keep()`` run at glibc's starting thresholds, so that they fault pages in whatever the C
library would have made of the process's history.
Each case runs in a fresh interpreter, since the thresholds are the whole process's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

_SCRIPT = textwrap.dedent("""
    import ctypes, os, resource, sys, torch
    from ssdsl.runtime import hostmem
    # glibc's starting thresholds (128 KiB), held there: its own adjustment of them depends on
    # what the process did before, so the steps before keep() would fault more or less
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 128 << 10) == 1 and libc.mallopt(-1, 128 << 10) == 1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 64))
    x = torch.randn(256, 64)

    def faults():
        for _ in range(3):
            model(x).square().mean().backward()
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            model(x).square().mean().backward()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0

    before = faults()
    if sys.argv[2:] == ["trainer"]:  # what a rank's trainer does when it is made
        from ssdsl.runtime.executor import RankProgram
        from ssdsl.runtime.job import JobSpec, plan_job
        from ssdsl.runtime.train import OptimizerSpec
        mf, m, full = plan_job(JobSpec(sys.argv[1], "dp", ()), 1)
        RankProgram(m, 0, mf, full, dtype=torch.float32, optimizer=OptimizerSpec("sgd", 0.1),
                    groups=None)
        kept = hostmem._DONE.get(os.getpid())
    else:
        kept = hostmem.keep()
    print(kept, before, faults(), hostmem.keep())
""")


def _run(env_value: str | None, *args: str) -> tuple[str, int, int, str]:
    env = dict(os.environ)
    env.pop("SSDSL_HOST_MEMORY", None)
    if env_value is not None:
        env["SSDSL_HOST_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", _SCRIPT, *args], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0], int(out[1]), int(out[2]), out[3]


def _glibc() -> bool:
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc")
def test_steps_after_keep_fault_no_pages_in():
    kept, before, after, again = _run(None)
    assert kept == "True" and again == "True"
    # ten steps of ~2 MiB of activations: thousands of pages faulted in afresh at the start
    assert before > 2000, before
    assert after * 10 < before, (before, after)


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc")
def test_release_leaves_the_c_library_defaults():
    kept, before, after, _ = _run("release")
    assert kept == "False"
    assert before > 2000 and after > 2000, (before, after)


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc")
def test_a_ranks_trainer_keeps_host_memory():
    """Making a ``RankProgram`` (every backend's trainer) sets the thresholds in its process."""
    from pathlib import Path
    model = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")
    kept, before, after, _ = _run(None, model, "trainer")
    assert kept == "True"
    assert before > 2000, before
    assert after * 10 < before, (before, after)
