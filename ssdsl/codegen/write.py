"""Writing generated modules to a folder: atomically, and never over a file ssdsl did not write.

Every file is first written beside its target and then renamed over it (``os.replace``), so a
reader sees the old or the new module, never half of one. Before anything is written, every
``.py`` file already in the folder must carry the generated mark: a folder holding hand-written
code is refused as a whole. Generated ``rank*.py`` and ``rank*.program`` files that the new compile does not produce
(a smaller world) are removed, so the folder always holds one consistent program.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

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


def write_programs(folder: str | Path, texts: Mapping[str, str | Callable[[], str]]
                   ) -> list[Path]:
    """Write ``texts`` (file name -> module text) into ``folder``; returns the paths written.

    A text may be a function that makes it: it is called when its file is written and not kept,
    so a 1,024-rank compile holds one module at a time
    (``{"rank0.py": functools.partial(generate_rank, m, 0, prov), ...}``)."""
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
    written = [_atomic_write(out / name, text() if callable(text) else text)
               for name, text in sorted(texts.items())]
    for p in existing:
        if re.fullmatch(r"rank\d+\.(py|program)", p.name) and p.name not in texts \
                and is_generated(p):
            p.unlink()
    return written


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
