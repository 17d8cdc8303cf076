"""The project's errors: one root class, one small subclass per rule.

Every error a user can cause (a plan, a model file, a flag) is an ``SsdslError``. The command line
prints it as ``plan.ssp:12:7: message``, the source line, carets under the span, and an optional
hint, then exits with status 2. Phases that find several independent faults raise ``ErrorGroup``
(sorted by position) instead of stopping at the first.

Subclasses live next to the rule that raises them (``ssdsl.parse.errors``, ...); they only need a
class docstring and, when useful, a ``default_hint`` (used when the raising site gives none).
"""

from __future__ import annotations

from collections.abc import Iterable

from ssdsl.source import Span


class SsdslError(Exception):
    """Root of every error caused by user input; the CLI shows these without a traceback."""

    #: What to do about it when the raising site gives no hint of its own (a class attribute).
    default_hint: str | None = None

    def __init__(self, message: str, span: Span | None = None, *, hint: str | None = None,
                 file: str | None = None, origin: Span | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint if hint is not None else type(self).default_hint
        # Where the model's code makes the operator a plan error names (a line of the model
        # file or of the library it calls, as HF's modeling file): shown as a note.
        self.origin = origin
        # For faults located in a file but not at a line (a model file missing a function, say).
        self.file = file if file is not None else (span.file if span else None)

    def sort_key(self) -> tuple:
        s = self.span
        return (s.file, s.line, s.column) if s else (self.file or "", 0, 0)

    def render(self) -> str:
        """The text the command line prints."""
        message = _cut(self.message)
        if self.span is not None:
            head = f"{self.span}: {message}"
        elif self.file:
            head = f"{self.file}: {message}"
        else:
            head = f"error: {message}"
        parts = [head]
        if self.span is not None:
            excerpt = self.span.excerpt()
            if excerpt:
                parts.append(excerpt)
        if self.hint:
            parts.append(f"hint: {_cut(self.hint)}")
        origin = getattr(self, "origin", None)  # errors copied by hand may lack it
        if origin is not None and origin != self.span:
            parts.append(f"note: the operator comes from {origin}")
            if excerpt := origin.excerpt():
                parts.append(excerpt)
        site = self.span.via if self.span is not None else None
        while site is not None:  # the user's `use` line, then the lines that led to it
            parts.append(f"note: in the plan used at {site}")
            if excerpt := site.excerpt():
                parts.append(excerpt)
            site = site.via
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.render()


MESSAGE_LIMIT = 600  # characters of a message or hint; what a user typed can be any length


def _cut(text: str) -> str:
    if len(text) <= MESSAGE_LIMIT:
        return text
    return f"{text[:MESSAGE_LIMIT]}... ({len(text):,} characters)"


class ErrorGroup(SsdslError):
    """Several independent errors of one input, reported together in source order."""

    def __init__(self, errors: Iterable[SsdslError]) -> None:
        flat: list[SsdslError] = []
        for err in errors:
            flat.extend(err.errors if isinstance(err, ErrorGroup) else [err])
        self.errors = _first_per_use(sorted(flat, key=SsdslError.sort_key))
        first = self.errors[0] if self.errors else None
        super().__init__(f"{len(self.errors)} errors", first.span if first else None)

    def render(self) -> str:
        return "\n\n".join(e.render() for e in self.errors)


def _first_per_use(errors: list[SsdslError]) -> list[SsdslError]:
    """Only the first error inside each used plan: the rest of a used plan usually fails because
    of its first fault (a cascade the user cannot act on separately)."""
    seen: set = set()
    out = []
    for e in errors:
        site = e.span.via if e.span is not None else None
        key = None if site is None else (site.file, site.line, site.column)
        if key is not None and key in seen:
            continue
        seen.add(key)
        out.append(e)
    return out


class UsageError(SsdslError):
    """A bad command-line flag or argument."""


class ErrorCollector:
    """Collects independent errors in one phase; ``raise_if_any`` raises them together.

    Usage::

        errors = ErrorCollector()
        for stmt in stmts:
            with errors.catch():
                check(stmt)
        errors.raise_if_any()
    """

    def __init__(self) -> None:
        self.errors: list[SsdslError] = []

    def add(self, error: SsdslError) -> None:
        self.errors.append(error)

    def catch(self) -> _Catch:
        return _Catch(self)

    def raise_if_any(self) -> None:
        errors = _distinct(self.errors)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ErrorGroup(errors)


def _distinct(errors: list[SsdslError]) -> list[SsdslError]:
    """``errors`` without repeats: the same statement failing the same way again (in each turn of
    a ``for`` loop) is one error."""
    seen: set[tuple] = set()
    out = []
    for e in errors:
        key = (type(e), getattr(e, "file", None), str(e.span) if e.span is not None else None,
               e.message, getattr(e, "hint", None))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


class _Catch:
    def __init__(self, collector: ErrorCollector) -> None:
        self.collector = collector

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, SsdslError):
            self.collector.add(exc)
            return True
        return False
