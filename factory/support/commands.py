"""What every `factory …` command line shares: a one-line error, and parsing argv into the chosen command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def fail(message: str, code: int = 2) -> int:
    """Print `error: message` to stderr and return the exit code (2: a usage or user error)."""
    print(f"error: {message}", file=sys.stderr)
    return code


def command_parser(*add_commands: Callable[[argparse._SubParsersAction], None],
                   description: str | None = None) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """A `factory` parser and its subparsers, with each `add_commands(subparsers)` already applied."""
    parser = argparse.ArgumentParser(prog="factory", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in add_commands:
        add(sub)
    return parser, sub


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse argv and run the command it names (each command sets `fn`); its return is the exit code."""
    args = parser.parse_args(argv)
    return args.fn(args)
