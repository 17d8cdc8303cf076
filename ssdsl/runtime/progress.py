"""What ``ssdsl run`` shows while it trains: phases, one line per step, a summary, a metrics file.

The ranks send ``Phase`` and ``StepMetrics`` events (``report_event``); the launcher feeds them to a
``Progress``, which waits until every rank has reported step k and then shows one ``StepRow`` for
it: the loss (the same on every rank), the time of the slowest rank (a step is as slow as its
slowest rank), samples and tokens per second derived from that time, the plan's communication per
step and the largest peak memory of any rank. Two kinds of output share that logic:

- ``LineProgress``: plain lines, written and flushed as each step completes (stdout is a file, a
  pipe or ``tee``), so a log shows progress while the job runs;
- ``LiveProgress``: on a terminal, the same lines scroll above a live panel that shows the phase,
  elapsed time, ETA, ms per step, the loss trend and one row per rank.

``MetricsFile`` writes the same rows as JSON Lines (``--metrics FILE``, schema in docs/json.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from ssdsl.schema import SCHEMA_VERSION

# No torch here: ``ssdsl run`` shows its first line before torch is imported.


@attrs.frozen
class StepMetrics:
    """One rank's numbers for one step (sent to the launcher as an event)."""

    rank: int
    step: int
    loss: float | None
    step_s: float
    samples_per_s: float
    comm_bytes: int
    peak_memory_bytes: int
    tokens_per_s: float | None = None  # when the inputs are token ids (``train.tokens_in``)


def human_bytes(n: float) -> str:
    """``219.0 KiB``: bytes in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@attrs.frozen
class Phase:
    """An event: what a rank is doing before (or after) its training steps."""

    name: str


@attrs.frozen
class StepRow:
    """One step over all ranks."""

    step: int
    loss: float | None
    step_s: float                  # the slowest rank's time
    samples_per_s: float
    tokens_per_s: float | None     # None when the inputs are not token ids
    comm_bytes: int
    peak_memory_bytes: int         # the largest over ranks
    ranks: tuple[StepMetrics, ...]

    def as_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "step": self.step, "loss": self.loss,
                "step_ms": self.step_s * 1e3, "samples_per_s": self.samples_per_s,
                "tokens_per_s": self.tokens_per_s, "communication_bytes": self.comm_bytes,
                "peak_memory_bytes": self.peak_memory_bytes,
                "ranks": [{"rank": m.rank, "step_ms": m.step_s * 1e3,
                           "peak_memory_bytes": m.peak_memory_bytes} for m in self.ranks]}

    def line(self, steps: int) -> str:
        """``step 3/20  loss 4.1519  10.5 ms/step  760 samples/s  ...``: one line, no colour."""
        width = len(str(steps))
        parts = [f"step {self.step + 1:>{width}}/{steps}",
                 "loss " + ("-" if self.loss is None else f"{self.loss:.4f}"),
                 f"{self.step_s * 1e3:.1f} ms/step", f"{self.samples_per_s:,.0f} samples/s"]
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        parts += [f"comm {human_bytes(self.comm_bytes)}",
                  f"mem {human_bytes(self.peak_memory_bytes)}"]
        return "  ".join(parts)


def combine(step: int, metrics: Sequence[StepMetrics]) -> StepRow:
    """Every rank's numbers for ``step`` as one row (see the module docstring)."""
    slowest = max(metrics, key=lambda m: m.step_s)
    loss = next((m.loss for m in metrics if m.loss is not None), None)
    tokens = slowest.tokens_per_s
    return StepRow(step=step, loss=loss, step_s=slowest.step_s,
                   samples_per_s=slowest.samples_per_s, tokens_per_s=tokens,
                   comm_bytes=max(m.comm_bytes for m in metrics),
                   peak_memory_bytes=max(m.peak_memory_bytes for m in metrics),
                   ranks=tuple(sorted(metrics, key=lambda m: m.rank)))


@attrs.frozen
class RunSummary:
    """The figures of a whole run, from its step rows (what the summary and ``--json`` show)."""

    steps: int
    wall_s: float                  # the whole command so far: planning, start-up, training
    train_s: float                 # the training steps themselves (their rows' times, summed)
    first_loss: float | None
    last_loss: float | None
    median_step_s: float
    samples_per_s: float
    tokens_per_s: float | None
    communication_bytes_per_step: int
    peak_memory_bytes: int
    peak_memory_rank: int

    @classmethod
    def of(cls, rows: Sequence[StepRow], *, wall_s: float, warmup: int = 1) -> RunSummary:
        """The median after ``warmup`` steps (the first pays for allocation and lazy init); the
        rates are the batch over that median, computed exactly as each step row's."""
        timed = list(rows[warmup:]) or list(rows)
        if not timed:
            return cls(0, wall_s, 0.0, None, None, 0.0, 0.0, None, 0, 0, 0)
        median = statistics.median(r.step_s for r in timed)
        ref = timed[0]
        per_step_samples = ref.samples_per_s * ref.step_s
        per_step_tokens = None if ref.tokens_per_s is None else ref.tokens_per_s * ref.step_s
        peak = max((m for r in rows for m in r.ranks), key=lambda m: m.peak_memory_bytes)
        return cls(steps=len(rows), wall_s=wall_s, train_s=sum(r.step_s for r in rows),
                   first_loss=rows[0].loss,
                   last_loss=rows[-1].loss, median_step_s=median,
                   samples_per_s=per_step_samples / median if median else 0.0,
                   tokens_per_s=(per_step_tokens / median if median and per_step_tokens
                                 is not None else None),
                   communication_bytes_per_step=rows[-1].comm_bytes,
                   peak_memory_bytes=peak.peak_memory_bytes, peak_memory_rank=peak.rank)

    def lines(self) -> list[str]:
        """A few readable lines: no Python dict, the same rates as the step lines."""
        def loss(x: float | None) -> str:
            return "-" if x is None else f"{x:.4f}"
        rate = f"{self.samples_per_s:,.0f} samples/s"
        if self.tokens_per_s is not None:
            rate += f", {self.tokens_per_s:,.0f} tokens/s"
        return [f"trained {self.steps} step{'s' if self.steps != 1 else ''} in "
                f"{_seconds(self.train_s)} ({_seconds(self.wall_s)} in all, with planning and "
                f"start-up): loss {loss(self.first_loss)} -> {loss(self.last_loss)}",
                f"  step time  {self.median_step_s * 1e3:.1f} ms (median after the first step, "
                f"slowest rank); {rate}",
                f"  peak mem   {human_bytes(self.peak_memory_bytes)} (rank "
                f"{self.peak_memory_rank})"]

    def as_json(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["median_step_ms"] = data.pop("median_step_s") * 1e3
        return data


def _seconds(s: float) -> str:
    """``0.12 s``, ``1.6 s``, ``42 s``: two significant figures or more."""
    return f"{s:.2f} s" if s < 1 else f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


class Progress:
    """Collects events per step; subclasses show phases and completed rows.

    ``nproc`` is the number of ranks whose events arrive here (1 under torchrun, where each
    process sees only its own).
    """

    def __init__(self, *, nproc: int, steps: int, first_step: int = 0,
                 metrics: MetricsFile | None = None) -> None:
        self.nproc, self.steps, self.first_step = nproc, steps, first_step
        self.metrics = metrics
        self.rows: list[StepRow] = []
        self.latest: dict[int, StepMetrics] = {}
        self.phases: dict[int, str] = {}
        self._pending: dict[int, dict[int, StepMetrics]] = {}
        self.started = time.monotonic()
        self.ended: float | None = None  # set when the progress closes (training is over)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ended = time.monotonic()
        if self.metrics is not None:
            # a run that failed before its first step leaves no empty file behind (which
            # would make the same command, run again, refuse its --metrics path)
            self.metrics.close(discard_empty=exc[0] is not None)

    def on_event(self, rank: int, event: Any) -> None:
        """``launch(..., on_event=progress.on_event)``."""
        if isinstance(event, Phase):
            self.phases[rank] = event.name
            self.show_phase(f"rank {rank}: {event.name}" if self.nproc > 1 else event.name,
                            rank=rank)
        elif isinstance(event, StepMetrics):
            self.latest[rank] = event
            got = self._pending.setdefault(event.step, {})
            got[rank] = event
            if len(got) == self.nproc:
                row = combine(event.step, list(self._pending.pop(event.step).values()))
                self.rows.append(row)
                if self.metrics is not None:
                    self.metrics.write(row)
                self.show_row(row)
            self.refresh()

    def configure(self, *, nproc: int, steps: int, first_step: int) -> None:
        """The job's shape, once it is known (the progress starts before it is, so that the
        first line comes before torch is loaded); before any event arrives."""
        self.nproc, self.steps, self.first_step = nproc, steps, first_step
        self.refresh()

    def phase(self, name: str) -> None:
        """A phase of the launcher itself (planning before the ranks start, saving after)."""
        self.show_phase(name, rank=None)

    def summary(self, *, warmup: int = 1) -> RunSummary:
        """The run's figures; its wall time ends where training ended (not after a --check)."""
        end = self.ended if self.ended is not None else time.monotonic()
        return RunSummary.of(self.rows, wall_s=end - self.started, warmup=warmup)

    def after(self, text: str) -> None:
        """A line about what the launcher does once training is over (the --check reference),
        so that a long wait after the last step is never silent."""
        self.show_after(f"[{time.monotonic() - self.started:6.1f} s] {text}")

    # what subclasses show
    def show_phase(self, text: str, *, rank: int | None) -> None:
        pass

    def show_row(self, row: StepRow) -> None:
        pass

    def refresh(self) -> None:
        pass

    def show_after(self, line: str) -> None:
        pass


class LineProgress(Progress):
    """Plain lines on ``stream``, flushed one by one. A phase is shown once per name (not once
    per rank), so N ranks starting up print one line per phase."""

    def __init__(self, *, stream: IO[str] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.stream = stream if stream is not None else sys.stdout
        self._shown: set[str] = set()

    def show_phase(self, text: str, *, rank: int | None) -> None:
        name = self.phases.get(rank, text) if rank is not None else text
        if name in self._shown:
            return
        self._shown.add(name)
        self._write(f"[{time.monotonic() - self.started:6.1f} s] {name}")

    def show_row(self, row: StepRow) -> None:
        self._write(row.line(self.first_step + self.steps))

    def show_after(self, line: str) -> None:
        self._write(line)

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class LiveProgress(Progress):
    """A live panel on a terminal: phase, elapsed, ETA, ms/step, loss trend, one row per rank;
    the step lines are printed above it as they complete."""

    def __init__(self, *, title: str, console: Any = None, **kw: Any) -> None:
        from rich.console import Console
        from rich.live import Live

        super().__init__(**kw)
        self.title = title
        self.console = console or Console()
        self.current_phase = "starting"
        self._live = Live(self.render(), console=self.console, refresh_per_second=4,
                          transient=True)

    def __enter__(self) -> LiveProgress:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.__exit__(*exc)
        super().__exit__(*exc)

    def show_phase(self, text: str, *, rank: int | None) -> None:
        self.current_phase = self.phases.get(rank, text) if rank is not None else text
        self.refresh()

    def show_row(self, row: StepRow) -> None:
        self.current_phase = "training"
        self.console.print(row.line(self.first_step + self.steps), highlight=False)

    def refresh(self) -> None:
        self._live.update(self.render())

    def show_after(self, line: str) -> None:
        self.console.print(line, highlight=False)

    def header(self) -> str:
        elapsed = time.monotonic() - self.started
        parts = [self.title, self.current_phase, f"elapsed {elapsed:.1f} s"]
        if self.rows:
            done = len(self.rows)
            per_step = statistics.median(r.step_s for r in self.rows[-10:])
            left = self.steps - done
            parts += [f"step {self.first_step + done}/{self.first_step + self.steps}",
                      f"{per_step * 1e3:.1f} ms/step", f"ETA {left * per_step:.1f} s"]
            losses = [r.loss for r in self.rows if r.loss is not None]
            if losses:
                trend = " ".join(f"{x:.3f}" for x in losses[-5:])
                parts.append(f"loss {trend}")
        return "  |  ".join(parts)

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title_justify="left", show_edge=False)
        for name in ("rank", "step", "loss", "ms/step", "comm/step", "peak mem"):
            table.add_column(name, justify="right")
        for rank in range(self.nproc):
            m = self.latest.get(rank)
            if m is None:
                table.add_row(str(rank), self.phases.get(rank, "starting"), "", "", "", "")
                continue
            table.add_row(str(rank), f"{m.step + 1}/{self.first_step + self.steps}",
                          "" if m.loss is None else f"{m.loss:.4f}", f"{m.step_s * 1e3:.1f}",
                          human_bytes(m.comm_bytes), human_bytes(m.peak_memory_bytes))
        return Group(Text(self.header(), style="bold"), table)


def make_progress(*, nproc: int, steps: int, title: str, first_step: int = 0,
                  metrics: MetricsFile | None = None, stream: IO[str] | None = None,
                  live: bool | None = None) -> Progress:
    """``LiveProgress`` when ``stream`` (default stdout) is a terminal, else ``LineProgress``."""
    stream = stream if stream is not None else sys.stdout
    if live is None:
        live = stream.isatty() and os.environ.get("TERM") != "dumb"
    kw = dict(nproc=nproc, steps=steps, first_step=first_step, metrics=metrics)
    if live:
        from rich.console import Console
        return LiveProgress(title=title, console=Console(file=stream), **kw)
    return LineProgress(stream=stream, **kw)


class MetricsFile:
    """``--metrics FILE``: one JSON object per step, flushed as each step completes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # "x": an existing file is never replaced; ssdsl does not overwrite files it did not make
        self._f = open(self.path, "x", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self.rows = 0

    def write(self, row: StepRow) -> None:
        self._f.write(json.dumps(row.as_json()) + "\n")
        self._f.flush()
        self.rows += 1

    def close(self, *, discard_empty: bool = False) -> None:
        """Close the file; with ``discard_empty``, remove it when no row was written (it is
        the file this object made: ``open(..., "x")`` never takes an existing one)."""
        if not self._f.closed:
            self._f.close()
            if discard_empty and self.rows == 0:
                self.path.unlink(missing_ok=True)
