"""`hybrid-transfer` command line: one small module per subcommand.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``handler`` to a function taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hybrid_transfer.errors import HybridTransferError

# Subcommands in the order `--help` lists them; a missing module is simply absent.
_SUBCOMMANDS = ("layout", "plan", "bench", "doctor", "soak")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-transfer",
        description="Move a hybrid model's cache (paged KV + GDN state) from prefill to decode over NIXL.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ERROR)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(f"hybrid_transfer.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name != f"hybrid_transfer.cli.{name}_cmd":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except HybridTransferError as exc:
        print(f"hybrid-transfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
