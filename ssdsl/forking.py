"""Work done in forked processes beside the caller's, where the system can fork.

A child starts with the caller's memory as it is (a 1,024-rank plan's programs are not copied
or pickled to reach it), runs one task, sends back what it returns or the exception it raised
(pickled, or its text where it does not pickle) through a pipe, and leaves without cleanup
(``os._exit``). The caller goes on meanwhile and collects the results in the order of the
tasks (``Forked.results``), which raises the first task's failure in that order.

Used by ``ssdsl.codegen.write`` (the per-rank files) and ``ssdsl.check.program`` (each
program's own checks beside the walk of their communication).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any


def can_fork() -> bool:
    """Whether this system forks (Linux and macOS do; Windows does not)."""
    return hasattr(os, "fork")


def usable_cores() -> int:
    """The cores this process may run on (its affinity; every core where that is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


class Forked:
    """Each task of ``tasks`` running in a forked child of its own, from the moment this is
    made; ``what`` names the work in the error a child that dies without a word leaves."""

    def __init__(self, tasks: Sequence[Callable[[], Any]], *, what: str = "work") -> None:
        self.what = what
        self._children: list[tuple[int, int]] = []
        for task in tasks:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: run the task, report, and leave without cleanup
                os.close(read)
                code = 0
                try:
                    data = pickle.dumps((True, task()))
                except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
                    code = 1
                    data = _failure(exc)
                try:
                    with os.fdopen(write, "wb") as f:
                        f.write(data)
                finally:
                    os._exit(code)
            os.close(write)
            self._children.append((pid, read))

    def results(self) -> list[Any]:
        """What each task returned, in order; the first failure (in the tasks' order) is
        raised, once every child has ended."""
        out: list[Any] = []
        failure: BaseException | None = None
        for pid, read in self._children:
            with os.fdopen(read, "rb") as f:
                data = f.read()
            _, status = os.waitpid(pid, 0)
            if failure is not None:
                continue
            if not data:
                failure = RuntimeError(f"a process doing {self.what} ended with status "
                                       f"{status} and no result")
                continue
            ok, value = pickle.loads(data)
            if ok:
                out.append(value)
            else:
                failure = _unpickled(value)
        self._children = []
        if failure is not None:
            raise failure
        return out


def _failure(exc: BaseException) -> bytes:
    text = f"{type(exc).__name__}: {exc}"
    try:
        return pickle.dumps((False, (text, pickle.dumps(exc))))
    except Exception:  # noqa: BLE001 - not picklable: its text
        return pickle.dumps((False, (text, None)))


def _unpickled(value: tuple[str, bytes | None]) -> BaseException:
    text, exc = value
    try:
        return pickle.loads(exc) if exc is not None else RuntimeError(text)
    except Exception:  # noqa: BLE001 - an exception whose constructor does not take its args
        return RuntimeError(text)
