"""Where a subcommand's output goes: `--json [PATH]` the same way on every subcommand.

``--json`` alone puts one JSON document on stdout and nothing else there: tables, progress and
anything NIXL or UCX print go to stderr. ``--json PATH`` writes the document to PATH (checked
before the work starts) and leaves stdout to the human-readable table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from hybrid_transfer.cli.common import check_output_path

STDOUT = "-"  # what `--json` without a path stands for; `--json -` says the same


def add_json_option(parser: argparse.ArgumentParser, document: str) -> None:
    """``--json [PATH]``; ``document`` says what the JSON holds."""
    parser.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="PATH",
                        help=f"{document}: on stdout alone (tables then go to stderr), or written to PATH")


def json_to_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) == STDOUT


def json_path(args: argparse.Namespace) -> Path | None:
    value = getattr(args, "json", None)
    return None if value in (None, STDOUT) else Path(value)


def check_json_path(args: argparse.Namespace) -> None:
    """Raise ConfigError for a --json PATH that cannot be written, before any work."""
    path = json_path(args)
    if path is not None:
        check_output_path(path, "--json")


def table_stream(args: argparse.Namespace) -> TextIO:
    """Where tables and progress go: stderr while stdout carries the JSON, else stdout."""
    return sys.stderr if json_to_stdout(args) else sys.stdout


def emit_json(args: argparse.Namespace, document: Any) -> None:
    """Print or write ``document`` as --json asked; nothing without --json."""
    if args.json is None:
        return
    text = json.dumps(document, indent=2)
    if json_to_stdout(args):
        print(text, flush=True)
    else:
        json_path(args).write_text(text + "\n")  # type: ignore[union-attr]


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True):
    """Route file descriptor 1 to stderr for the block: NIXL's logger and UCX print to stdout,
    and so may child processes, which inherit the descriptor."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
