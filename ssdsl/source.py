"""Source positions: every AST and IR node that came from a plan carries a frozen ``Span``.

``Span.from_meta`` is the one helper that turns Lark's ``meta`` (``propagate_positions=True``)
into a position; ``SourceFile`` keeps the text so that errors can show the line with carets.
"""

from __future__ import annotations

from typing import Any

import attrs

# Text of every plan file read in this process, by the name spans use, so an error raised far
# from the parser can still print its source line.
_TEXTS: dict[str, str] = {}


def remember_source(name: str, text: str) -> None:
    """Record ``text`` as the content of ``name`` for later error rendering."""
    _TEXTS[name] = text


def source_text(name: str) -> str | None:
    """The text recorded for ``name``, or ``None`` when it was never read."""
    return _TEXTS.get(name)


@attrs.frozen(order=True)
class Span:
    """A region of a source file; lines and columns are 1-based, ``end_column`` is exclusive."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int
    # The ``use`` statement through which this plan text was reached (itself possibly reached
    # through another); not part of the position, so equal positions compare equal.
    via: Span | None = attrs.field(default=None, eq=False, order=False, repr=False)

    def reached_via(self, site: Span | None) -> Span:
        """This span, noted as reached through the ``use`` at ``site`` (kept if already noted)."""
        if site is None or self.via is not None:
            return self
        return attrs.evolve(self, via=site)

    @classmethod
    def from_meta(cls, file: str, meta: Any) -> Span:
        """Build a span from a Lark ``meta`` or token (anything with line/column attributes)."""
        line = getattr(meta, "line", None) or 1
        column = getattr(meta, "column", None) or 1
        end_line = getattr(meta, "end_line", None) or line
        end_column = getattr(meta, "end_column", None) or column + 1
        return cls(file, line, column, end_line, end_column)

    @classmethod
    def point(cls, file: str, line: int, column: int, width: int = 1) -> Span:
        """A span of ``width`` characters on one line."""
        return cls(file, line, column, line, column + width)

    def to(self, other: Span) -> Span:
        """The span from the start of ``self`` to the end of ``other``."""
        return attrs.evolve(self, end_line=other.end_line, end_column=other.end_column)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def excerpt(self) -> str:
        """The first source line of the span with carets under it ('' when the text is unknown)."""
        text = source_text(self.file)
        if text is None:
            return ""
        lines = text.splitlines()
        if not 1 <= self.line <= len(lines):
            return ""
        src = lines[self.line - 1]
        end = self.end_column if self.end_line == self.line else len(src) + 1
        src, column, end = _window(src, self.column, end)
        width = max(1, end - column)
        gutter = f"{self.line:>4} | "
        return f"{gutter}{src}\n{' ' * len(gutter)}{' ' * (column - 1)}{'^' * width}"


EXCERPT_WIDTH = 120


def _window(src: str, column: int, end: int) -> tuple[str, int, int]:
    """A long line cut to ``EXCERPT_WIDTH`` characters around ``column`` (marked with '...'),
    with the column and end moved to match; a 400 KB line is never echoed whole."""
    if len(src) <= EXCERPT_WIDTH:
        return src, column, end
    start = max(0, min(column - 1 - EXCERPT_WIDTH // 3, len(src) - EXCERPT_WIDTH))
    stop = start + EXCERPT_WIDTH
    head = "..." if start > 0 else ""
    tail = "..." if stop < len(src) else ""
    shift = start - len(head)
    return (head + src[start:stop] + tail, column - shift,
            min(end, stop + 1) - shift)


def file_line(path: str, line: int, shown: str | None = None) -> Span:
    """A span over ``line`` of the file at ``path`` (from its first non-blank character), named
    ``shown`` (default ``path``) in messages, with the file's text remembered for the excerpt."""
    name = shown or path
    text = source_text(name)
    if text is None:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        remember_source(name, text)
    lines = text.splitlines()
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    column = len(src) - len(src.lstrip())
    return Span.point(name, line, column + 1, max(1, len(src.rstrip()) - column))


def shown_path(path: str) -> str:
    """``path`` as a message shows it: relative to the working folder when inside it, from the
    package down when installed (``transformers/models/bert/modeling_bert.py``)."""
    import os
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel
