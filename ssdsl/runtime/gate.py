"""The gate the ranks wait at before their first training step, while the launcher verifies.

``ssdsl run`` verifies the job against the plain model before any rank trains (DESIGN §7,
``ssdsl.runtime.preflight``). Starting the ranks (processes, imports, process groups, their
plans and shards) takes far longer than verifying a job that fits one process, so the launcher
verifies while they start: each rank does everything up to its first step, then waits here
until the launcher opens the gate. A job that fails verification never takes a step: the
launcher refuses the gate, stops the ranks and reports the difference at its plan line.

The gate is a file in the launcher's temporary folder, written once and whole (renamed into
place), holding ``go`` or ``stop``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_POLL_S = 0.002


class GateRefused(Exception):
    """The launcher refused the gate: the job failed verification (the launcher reports why)."""


class Gate:
    """One job's gate at ``path``: the launcher calls ``open`` or ``refuse``, ranks ``wait``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def open(self) -> None:
        self._write("go")

    def refuse(self) -> None:
        self._write("stop")

    def _write(self, word: str) -> None:
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(word)
        os.replace(part, self.path)

    def wait(self) -> float:
        """Block until the gate is decided; the seconds waited. Raises ``GateRefused`` when it
        was refused. No time limit: a rank whose launcher dies dies with it."""
        start = time.perf_counter()
        while True:
            try:
                word = self.path.read_text()
            except FileNotFoundError:
                time.sleep(_POLL_S)
                continue
            if word == "go":
                return time.perf_counter() - start
            raise GateRefused("the launcher stopped the job: it failed verification")
