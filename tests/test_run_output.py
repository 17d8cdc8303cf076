"""What `ssdsl run` shows: step lines streamed while the job runs, a live panel on a terminal,
a readable summary whose rates agree with the step lines, a JSON Lines metrics file.

Oracles: the streamed lines are read by a second process before the job ends (the job is held at
step 2 by its own model file until the test releases it); rates are recomputed from the times
the rows carry; the metrics file is compared with the losses of the single-device reference.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ssdsl.runtime.progress import (LineProgress, LiveProgress, MetricsFile, Phase, RunSummary,
                                    combine)
from ssdsl.runtime.train import StepMetrics

ROOT = Path(__file__).resolve().parent.parent

# A model file that blocks in get_batch(2) until the test creates the file named by HOLD.
HELD_MODEL = textwrap.dedent('''
    import os, time, torch
    from torch import nn

    BATCH_SIZE = 4

    def build_model():
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))

    def get_batch(step, batch_size):
        while step >= 2 and "HOLD" in os.environ and not os.path.exists(os.environ["HOLD"]):
            time.sleep(0.05)
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 3, generator=g), torch.randint(0, 2, (batch_size,), generator=g)
''')


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_step_lines_stream_before_the_job_ends(tmp_path):
    model = tmp_path / "held.py"
    model.write_text(HELD_MODEL)
    hold = tmp_path / "go"
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssdsl", "run", str(model), "dp", "--world", "2", "--steps", "4",
         "--metrics", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env=_env(HOLD=str(hold)))
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if line.startswith("step 2/4"):
                break
        assert seen[-1].startswith("step 2/4"), "".join(seen)
        assert proc.poll() is None  # still running: held at step 2
        assert any(line.startswith("step 1/4  loss ") for line in seen)
        assert any("starting 2 ranks" in line for line in seen)  # the phase is shown
        # the metrics file is written as the steps complete, too
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1]
        hold.write_text("")
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    out = "".join(seen) + rest
    lines = out.splitlines()
    assert [x[:8] for x in lines if x.startswith("step ")] == [f"step {i}/4" for i in (1, 2, 3, 4)]
    assert "{" not in out  # a readable summary, not a Python dict
    summary = next(x for x in lines if x.startswith("trained 4 steps"))
    assert "loss" in summary and "in all, with planning and start-up" in summary
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert len(rows) == 4 and all(r["schema_version"] == 1 for r in rows)
    for r in rows:  # the rate is the batch over the slowest rank's time
        assert r["samples_per_s"] == pytest.approx(4 / (max(x["step_ms"] for x in r["ranks"]) / 1e3))
    from ssdsl.runtime.reference import run_reference
    from ssdsl.trace.model_file import load_model_file
    ref = run_reference(load_model_file(model), steps=4)
    assert [r["loss"] for r in rows] == pytest.approx(list(ref.losses), rel=1e-5)


@pytest.mark.slow
def test_errors_and_lines_never_share_a_line(tmp_path):
    """stdout and stderr into one file: every message starts its own line."""
    model = tmp_path / "bad.py"
    model.write_text(HELD_MODEL.replace("while step >= 2", "if step >= 1: raise ValueError('bad batch')\n"
                                        "    while step >= 2"))
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "ssdsl", "run", str(model), "dp",
                               "--world", "2", "--steps", "3"], stdout=f, stderr=f,
                              cwd=tmp_path, env=_env(HOLD=str(tmp_path / "never")),
                              timeout=180).returncode
    text = log.read_text()
    assert code == 2, text
    lines = text.splitlines()
    assert any(x.startswith("step 1/3  loss") for x in lines), text
    errors = [x for x in lines if "error:" in x]
    assert errors and all(x.startswith("error:") for x in errors), text  # never mid-line
    assert any("bad batch" in x for x in errors), text
    assert not any(x.startswith("step ") and "error:" in x for x in lines), text


def _metrics(rank: int, step: int, step_s: float, loss: float = 1.0) -> StepMetrics:
    return StepMetrics(rank=rank, step=step, loss=loss, step_s=step_s, samples_per_s=8 / step_s,
                       comm_bytes=100, peak_memory_bytes=2**20 * (rank + 1), tokens_per_s=None)


def test_a_row_waits_for_every_rank_and_takes_the_slowest():
    stream = io.StringIO()
    p = LineProgress(nproc=2, steps=3, stream=stream)
    p.on_event(0, Phase("planning"))
    p.on_event(1, Phase("planning"))  # one line per phase, not one per rank
    p.on_event(0, _metrics(0, 0, 0.010))
    assert "step" not in stream.getvalue()  # rank 1 has not finished step 0
    p.on_event(1, _metrics(1, 0, 0.020))
    lines = stream.getvalue().splitlines()
    assert sum("planning" in x for x in lines) == 1
    assert lines[-1].startswith("step 1/3  loss 1.0000  20.0 ms/step  400 samples/s")
    assert "comm 100 B" in lines[-1] and "mem 2.0 MiB" in lines[-1]  # the larger rank's peak


def test_summary_rates_agree_with_the_step_rows():
    """The summary's samples/s is the batch over the median step time, as each row's is the batch
    over its own time; a median of rates would disagree (the issue's 359.5 vs 424.7)."""
    times = [0.5, 0.010, 0.030, 0.020, 0.012]
    rows = [combine(i, [_metrics(0, i, t), _metrics(1, i, t / 2)]) for i, t in enumerate(times)]
    s = RunSummary.of(rows, wall_s=1.0)
    assert s.median_step_s == pytest.approx(0.016)  # median of the 4 after the first
    assert s.samples_per_s == pytest.approx(8 / 0.016)
    assert s.peak_memory_rank == 1 and s.first_loss == 1.0
    assert s.train_s == pytest.approx(sum(times))  # the steps, not planning and start-up
    text = "\n".join(s.lines())
    assert "500 samples/s" in text and "{" not in text
    assert text.startswith("trained 5 steps in 0.57 s (1.0 s in all, with planning")


def test_the_summary_ends_with_training_and_later_work_is_announced():
    """The wall time stops when the progress closes (a --check reference trained afterwards is
    not counted as training), and what runs after it gets a line of its own."""
    stream = io.StringIO()
    with LineProgress(nproc=1, steps=1, stream=stream) as p:
        p.on_event(0, _metrics(0, 0, 0.010))
    first = p.summary().wall_s
    p.after("checking: training the single-device reference for 1 step and comparing")
    assert p.summary().wall_s == first
    last = stream.getvalue().splitlines()[-1]
    assert last.endswith("] checking: training the single-device reference for 1 step and "
                         "comparing") and last.startswith("[")


def test_live_panel_shows_phase_elapsed_eta_and_loss_trend():
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160, force_terminal=True)
    with LiveProgress(nproc=2, steps=4, title="ssdsl run m.py dp", console=console) as p:
        p.on_event(0, Phase("tracing"))
        header = p.header()
        assert "tracing" in header and "elapsed" in header
        for step, loss in enumerate((2.0, 1.5)):
            for rank in (0, 1):
                p.on_event(rank, _metrics(rank, step, 0.1, loss=loss))
        header = p.header()
    assert "step 2/4" in header and "100.0 ms/step" in header and "ETA 0.2 s" in header
    assert "2.000 1.500" in header  # the loss trend
    printed = console.file.getvalue()
    assert "step 1/4  loss 2.0000" in printed  # step lines scroll above the panel


def test_tokens_per_second_for_token_inputs():
    from ssdsl.runtime.train import tokens_in
    assert tokens_in((torch.zeros(4, 16, dtype=torch.long),)) == 64
    assert tokens_in((torch.zeros(4, 16),)) is None


def test_a_run_that_fails_before_its_first_step_leaves_no_metrics_file(tmp_path, capsys):
    """Else the same command, run again after the fix, refuses its --metrics path as taken.
    Oracle: the directory listing; a file with rows is kept (below)."""
    from ssdsl.cli import main
    metrics = tmp_path / "m.jsonl"
    mlp = str(ROOT / "examples" / "mlp.py")
    assert main(["run", mlp, "dp", "--world", "2", "--set", "world=3",
                 "--metrics", str(metrics)]) == 2
    assert "disagrees" in capsys.readouterr().err
    assert not metrics.exists()
    kept = tmp_path / "k.jsonl"
    with pytest.raises(RuntimeError):
        with LineProgress(nproc=1, steps=2, stream=io.StringIO(),
                          metrics=MetricsFile(kept)) as p:
            p.on_event(0, _metrics(0, 0, 0.01))
            raise RuntimeError("a rank failed at step 1")
    assert [json.loads(x)["step"] for x in kept.read_text().splitlines()] == [0]
