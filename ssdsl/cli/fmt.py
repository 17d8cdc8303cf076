"""``ssdsl fmt PLAN...``: rewrite plans in canonical form (comments and docstrings kept)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ssdsl.elaborate import find_plan
from ssdsl.errors import UsageError
from ssdsl.elaborate.loader import display_name
from ssdsl.errors import ErrorCollector, SsdslError
from ssdsl.parse.format import format_text


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("fmt", help="rewrite plans in canonical form",
                              description="Rewrite each PLAN in canonical form. Comments and "
                              "docstrings are kept; files are replaced atomically.")
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan files or stdlib plan names")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 when a file would change")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    errors = ErrorCollector()
    changed: list[str] = []
    for ref in args.plans:
        with errors.catch():
            path = find_plan(ref)
            if not args.check and not Path(ref).is_file():
                raise UsageError(f"'{ref}' is a stdlib plan, not a file: fmt rewrites files in "
                                 "place and does not change the installed stdlib",
                                 hint=f"use `ssdsl fmt --check {ref}`, or copy {path} and "
                                 "format the copy")
            if _format_one(path, check=args.check):
                changed.append(display_name(path))
    for name in changed:
        print(f"{'would reformat' if args.check else 'reformatted'} {name}", file=sys.stderr)
    errors.raise_if_any()
    return 1 if (args.check and changed) else 0


def _format_one(path: Path, *, check: bool) -> bool:
    """Format one file; True when it changed (or would)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SsdslError(f"cannot read {path}: {exc}", file=str(path)) from None
    out = format_text(text, display_name(path))
    if out == text:
        return False
    if not check:
        write_atomically(path, out)
    return True


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` so a reader sees the old or the new file, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        except OSError:
            pass
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
