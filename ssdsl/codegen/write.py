"""Writing generated modules to a folder: atomically, and never over a file ssdsl did not write.

Every file is first written beside its target and then renamed over it (``os.replace``), so a
reader sees the old or the new module, never half of one. Before anything is written, every
``.py`` file already in the folder must carry the generated mark: a folder holding hand-written
code is refused as a whole. Generated ``rank*.py`` and ``rank*.program`` files that the new compile does not produce
(a smaller world) are removed, so the folder always holds one consistent program.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ssdsl.codegen.emit import GENERATED_MARK
from ssdsl.errors import SsdslError


class NotGenerated(SsdslError):
    """The output folder holds a file that ssdsl did not generate (it would be overwritten)."""


def is_generated(path: Path) -> bool:
    """Whether ``path`` starts with the generated mark."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(GENERATED_MARK)
    except OSError:
        return False


def default_jobs() -> int:
    """How many processes write generated files: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def write_programs(folder: str | Path, texts: Mapping[str, str | Callable[[], str]], *,
                   jobs: int = 1, order: Callable[[str], Any] | None = None) -> list[Path]:
    """Write ``texts`` (file name -> module text) into ``folder``; returns the paths written.

    A text may be a function that makes it: it is called when its file is written and not kept,
    so a 1,024-rank compile holds one module at a time
    (``{"rank0.py": functools.partial(generate_rank, m, 0, prov), ...}``). With ``jobs`` > 1
    (where the system can fork) the functions run in that many forked processes, each writing
    a share of the files; the files are the same (``tests/test_codegen_write.py``), and an
    error raised in one is raised here. Each process takes a run of consecutive files in
    ``order`` (a sort key of a file's stem; default: the stems in natural order), so files
    whose making shares work (the ranks of one class: ``rank_order``) are made by one process
    and the shared work is done once, not once per process."""
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise NotGenerated(f"{out} exists and is not a folder",
                           hint="give -o a folder path (it is created when missing)")
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p for p in out.iterdir()
                      if p.suffix in (".py", ".program") or p.name in texts)
    foreign = [p for p in existing if not is_generated(p)]
    if foreign:
        names = ", ".join(p.name for p in foreign)
        raise NotGenerated(f"{out} holds files that ssdsl did not generate: {names}",
                           hint="choose an empty folder, or move those files away")
    items = sorted(texts.items())
    if jobs > 1 and hasattr(os, "fork") and len(items) >= 2 * jobs:
        written = _write_forked(out, items, jobs, order)
    else:
        written = [_atomic_write(out / name, text() if callable(text) else text)
                   for name, text in items]
    for p in existing:
        if re.fullmatch(r"rank\d+\.(py|program)", p.name) and p.name not in texts \
                and is_generated(p):
            p.unlink()
    return written


def _write_forked(out: Path, items: list, jobs: int, order: Callable[[str], Any] | None = None
                  ) -> list[Path]:
    """Each of ``jobs`` forked children writes its share of ``items``; a child that fails sends its
    exception back through a pipe (pickled, or its text when it does not pickle)."""
    shares = _shares(items, jobs, order)
    children = []
    for k in range(jobs):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: write its share, report, and leave without cleanup
            os.close(read)
            code = 0
            try:
                for name, text in shares[k]:
                    _atomic_write(out / name, text() if callable(text) else text)
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
                code = 1
                text = f"{type(exc).__name__}: {exc}"
                try:
                    data = pickle.dumps((text, pickle.dumps(exc)))
                except Exception:  # noqa: BLE001 - not picklable: its text
                    data = pickle.dumps((text, None))
                with os.fdopen(write, "wb") as f:
                    f.write(data)
            os._exit(code)
        os.close(write)
        children.append((pid, read))
    failure = None
    for pid, read in children:
        with os.fdopen(read, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if failure is None and (data or status != 0):
            failure = _unpickled(data) if data else RuntimeError(
                f"a process writing generated files ended with status {status}")
    if failure is not None:
        raise failure
    return [out / name for name, _ in items]


def _shares(items: list, jobs: int, order: Callable[[str], Any] | None = None) -> list[list]:
    """``items`` dealt to ``jobs`` writers: the files of one stem (rank3.py, rank3.program) to
    one, each a run of consecutive stems in ``order`` (then natural order), the runs' lengths
    differing by one stem at most."""
    ordered = sorted({Path(name).stem for name, _ in items},
                     key=(lambda stem: (order(stem), _natural(stem))) if order else _natural)
    stems = {stem: i * jobs // len(ordered) for i, stem in enumerate(ordered)}
    return [[it for it in items if stems[Path(it[0]).stem] == k] for k in range(jobs)]


def _natural(stem: str) -> tuple:
    """``rank10`` after ``rank9``: the digits compared as a number."""
    head = stem.rstrip("0123456789")
    tail = stem[len(head):]
    return (head, int(tail) if tail else -1)


def _unpickled(data: bytes) -> BaseException:
    text, exc = pickle.loads(data)
    try:
        return pickle.loads(exc) if exc is not None else RuntimeError(text)
    except Exception:  # noqa: BLE001 - an exception whose constructor does not take its args
        return RuntimeError(text)


def _atomic_write(path: Path, text: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
