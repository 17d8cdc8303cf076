"""Writing generated modules to a folder: atomically, and never over a file ssdsl did not write.

Every file is first written beside its target and then renamed over it (``os.replace``), so a
reader sees the old or the new module, never half of one. Before anything is written, every
``.py`` file already in the folder must carry the generated mark: a folder holding hand-written
code is refused as a whole. Generated ``rank*.py`` and ``rank*.program`` files that the new compile does not produce
(a smaller world) are removed, so the folder always holds one consistent program.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ssdsl.codegen.emit import GENERATED_MARK
from ssdsl.errors import SsdslError
from ssdsl.forking import Forked, can_fork, usable_cores


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
    return usable_cores()


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
    if jobs > 1 and can_fork() and len(items) >= 2 * jobs:
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
    """Each of ``jobs`` forked children writes its share of ``items``; a child's failure is
    raised here (``ssdsl.forking``)."""
    shares = _shares(items, jobs, order)
    Forked([functools.partial(_write_share, out, share) for share in shares],
           what="writing generated files").results()
    return [out / name for name, _ in items]


def _write_share(out: Path, share: list) -> None:
    for name, text in share:
        _atomic_write(out / name, text() if callable(text) else text)


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
