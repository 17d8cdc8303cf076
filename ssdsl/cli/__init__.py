"""The ``ssdsl`` command line.

Each subcommand is a module ``ssdsl/cli/<name>.py`` exposing ``register(subparsers)``, which adds
its parser and sets ``func`` (called with the parsed namespace, returning the exit status).
Errors the user caused (``SsdslError``) print without a traceback and exit with status 2;
``--debug`` re-raises them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ssdsl.errors import SsdslError
from ssdsl.schema import SCHEMA_VERSION

# In the order ``ssdsl --help`` lists them, which is the order a user meets them.
COMMANDS = ("plans", "trace", "check", "fmt", "show", "cost", "compile", "run", "merge")


class _Parser(argparse.ArgumentParser):
    """argparse exits with status 2 on bad flags already; keep its message, drop the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a batch size, a count of steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ssdsl", description="Parallelization plans for PyTorch models: "
                     "partition, replicate, assign, order.")
    parser.add_argument("--version", action="version", version=f"ssdsl {version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"ssdsl.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"ssdsl.cli.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    for command in sub.choices.values():
        # `ssdsl run ... --debug` as well as `ssdsl --debug run ...` (errors say "run with
        # --debug"); SUPPRESS keeps the top-level value when the flag is not repeated here.
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks of errors")
    return parser


def version() -> str:
    """The installed distribution's version, or the source tree's."""
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version
        return dist_version("ssdsl")
    except PackageNotFoundError:
        import ssdsl
        return ssdsl.__version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ssdsl`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except SsdslError as err:
        if args.debug:
            _drop_debug_advice(err)
            raise
        if getattr(args, "json", False):
            print_json_error(err, getattr(args, "command", None))
        else:
            print(err.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ssdsl ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


def _drop_debug_advice(err: SsdslError) -> None:
    """Under ``--debug`` the traceback follows the message: a hint saying "run with --debug"
    would send the user round in a circle, so that clause goes (the rest of the hint stays)."""
    from ssdsl.errors import ErrorGroup
    for e in err.errors if isinstance(err, ErrorGroup) else [err]:
        if e.hint and "--debug" in e.hint:
            e.hint = "; ".join(c for c in e.hint.split("; ") if "--debug" not in c) or None


def error_json(err: SsdslError, command: str | None = None) -> dict:
    """An error as the ``--json`` commands print it (docs/json.md)."""
    from ssdsl.errors import ErrorGroup
    errors = err.errors if isinstance(err, ErrorGroup) else [err]
    return {"schema_version": SCHEMA_VERSION, "command": command, "ok": False,
            "errors": [{"kind": type(e).__name__, "message": e.message,
                        "file": e.file, "line": e.span.line if e.span else None,
                        "column": e.span.column if e.span else None, "hint": e.hint,
                        "origin": _origin_json(e), "text": e.render()} for e in errors]}


def _origin_json(err: SsdslError) -> dict | None:
    origin = getattr(err, "origin", None)
    return None if origin is None else {"file": origin.file, "line": origin.line}


def print_json_error(err: SsdslError, command: str | None = None) -> None:
    """Under ``--json`` an error is JSON on stdout too (a tool reads one stream); the text form
    still goes to stderr for a person watching."""
    import json
    print(json.dumps(error_json(err, command), indent=1))
    print(err.render(), file=sys.stderr)


def run_main() -> None:
    """The console script: ``main``, then an exit that skips the interpreter's teardown.

    Tearing down torch's modules and the traced graphs takes 1-3 s after the last line on a
    loaded machine, and longer under load, in which the command looks hung. Every file a
    command writes is closed by then (context managers), so only the standard streams need a
    flush; ``os._exit`` then ends the process at once with the same status.
    """
    import os
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError, OSError):  # a reader that left, a closed stream
            pass
    os._exit(code)
