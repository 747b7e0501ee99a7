"""`hybrid-transfer` command line: one small module per subcommand.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``handler`` to a function taking the parsed args and returning an exit code.

One grammar for all of them: global options (``--log-level``) before or after the subcommand,
``--json [PATH]`` on every subcommand (cli/output.py), "did you mean" for a mistyped subcommand,
choice or option, and a quiet exit when stdout is a pipe that closed (``... --json | head``).
Parsing imports no torch, NIXL or ZeroMQ: a usage error returns at once; the handlers import
what their work needs.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import select
import sys

from hybrid_transfer.errors import HybridTransferError

# Subcommands in the order `--help` lists them; a missing module is simply absent.
_SUBCOMMANDS = ("layout", "plan", "bench", "doctor", "soak")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# NIXL's own logger (a line per agent at INFO, on stdout) follows --log-level only when asked for
# more than warnings; NIXL_LOG_LEVEL in the environment wins.
_NIXL_LEVELS = {"DEBUG": "DEBUG", "INFO": "INFO"}
# The exit status a shell reports for a program that SIGPIPE ended (128 + 13): `cmd | head` with pipefail.
EXIT_CLOSED_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a value outside its choices (subcommands included) and, on a
    subcommand's parser, for a mistyped option in any of its errors."""

    hint_options = False  # set on subcommand parsers: the top level sees their flags as unknown

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _check_value(self, action, value):
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            guess = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1)
            if not guess:
                raise
            raise argparse.ArgumentError(action, f"{exc.message}; did you mean {guess[0]!r}?") from None

    def error(self, message):
        if self.hint_options:
            message += "".join(self._option_hints())
        super().error(message)

    def _option_hints(self):
        known = list(self._option_string_actions)
        for arg in getattr(self, "_argv", ()):
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--") or any(option.startswith(flag) for option in known):
                continue  # argparse takes a unique prefix of an option
            guess = difflib.get_close_matches(flag, known, n=1)
            if guess:
                yield f"; {flag} is not an option, did you mean {guess[0]!r}?"


def _add_global_options(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    # A subcommand's copy has no default, so it only overrides the top level's when given.
    group = parser.add_argument_group("global options (before or after the subcommand)")
    group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                       default="WARNING" if top_level else argparse.SUPPRESS,
                       help="logging level on stderr; DEBUG and INFO also let NIXL log at that level")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybrid-transfer",
        description="Move a hybrid model's cache (paged KV + GDN state) from prefill to decode over NIXL.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_global_options(parser, top_level=True)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(f"hybrid_transfer.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name != f"hybrid_transfer.cli.{name}_cmd":
                raise
            continue
        module.register(subparsers)
    for sub in subparsers.choices.values():
        _add_global_options(sub, top_level=False)
        sub.hint_options = True
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, with an unrecognized argument reported by its subcommand (whose usage and options fit)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def _stdout_closed() -> bool:
    """True when fd 1 is a pipe whose reader went away (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if args.log_level in _NIXL_LEVELS:  # before anything imports NIXL; rank processes inherit it
        os.environ.setdefault("NIXL_LOG_LEVEL", _NIXL_LEVELS[args.log_level])
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except HybridTransferError as exc:
        print(f"hybrid-transfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a pipe of the work itself (a rank process's), not our stdout
        # Nothing more can reach the reader; point fd 1 at /dev/null so the exit flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        return EXIT_CLOSED_PIPE
