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

# In the order ``ssdsl --help`` lists them, which is the order a user meets them.
COMMANDS = ("plans", "trace", "check", "fmt", "show", "cost", "compile", "run")


class _Parser(argparse.ArgumentParser):
    """argparse exits with status 2 on bad flags already; keep its message, drop the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ssdsl", description="Parallelization plans for PyTorch models: "
                     "partition, replicate, assign, order.")
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
    return parser


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
            raise
        print(err.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run_main() -> None:
    sys.exit(main())
