"""`hybrid-transfer soak`: thousands of requests between a prefill and a decode process, faults mixed in."""

from __future__ import annotations

import argparse
import sys

import msgspec

from hybrid_transfer.cli.output import (
    add_json_option,
    check_json_path,
    emit_json,
    json_to_stdout,
    stdout_to_stderr,
    table_stream,
)
from hybrid_transfer.errors import ConfigError


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 0.3:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 0.3]")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    from hybrid_transfer.engine.config import READ_TRANSPORTS
    from hybrid_transfer.soak import SoakSpec

    d = SoakSpec()
    parser = subparsers.add_parser(
        "soak",
        help="run thousands of requests between a prefill and a decode process with faults; check nothing leaks",
        description=(
            "Spawns a prefill process (one Producer) and a decode process (one Consumer) on loopback, with "
            "authentication on (a random shared secret in HYBRID_TRANSFER_SECRET unless one is set), and moves "
            "--requests requests in batches: random token counts, blocks drawn at random from the free pool "
            "(fragmentation), about --abort-rate of them aborted by each side after a random number of polls, "
            "--stall-rate handed to the consumer only after their lease expired, replayed and edited tickets, "
            "forged notifications and a handshake with a wrong secret; a second consumer declines, aborts or reads "
            "live tickets and feeds hostile kv_transfer_params (docs/soak.md#rival). The producer and the consumer are each "
            "killed once with SIGKILL while reads are in flight and started again. Every DONE request's bytes "
            "are checked against a global oracle. Prints completed, failed by cause, bytes verified, blocks "
            "pinned, quarantined, handles leaked and RSS growth. Exit code 0 only when every request ended "
            "exactly once on each side, no byte was wrong, no attack ended DONE, and nothing is left pinned, "
            "quarantined or alive in NIXL; 1 otherwise; 2 for bad arguments. See docs/soak.md."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--requests", type=_positive, default=d.requests, help="requests to move")
    parser.add_argument("--batch", type=_positive, default=d.batch, help="requests held and read together")
    parser.add_argument("--model", default=d.model,
                        help="'tiny' (a built-in 8-layer hybrid model, 1 KiB pages) or a preset name")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="token counts are drawn in [0, this]")
    parser.add_argument("--num-blocks", type=_positive, default=d.num_blocks, help="blocks per cache on each side")
    parser.add_argument("--abort-rate", type=_rate, default=d.abort_rate, help="share aborted by each side")
    parser.add_argument("--stall-rate", type=_rate, default=d.stall_rate,
                        help="share whose ticket reaches the consumer after its lease expired")
    parser.add_argument("--replay-rate", type=_rate, default=d.replay_rate,
                        help="extra reads of tickets already read and freed, per request")
    parser.add_argument("--edit-rate", type=_rate, default=d.edit_rate, help="share read through an edited ticket")
    parser.add_argument("--lease", type=float, default=d.lease_s, help="lease in seconds")
    parser.add_argument("--read-deadline", type=float, default=d.read_deadline_s, help="consumer read deadline (s)")
    parser.add_argument("--no-kills", action="store_true", help="do not kill and restart the processes")
    parser.add_argument("--no-auth", action="store_true", help="run without a shared secret (forged Completions "
                        "are then left out: without a secret they cannot be told from real ones)")
    parser.add_argument("--hostile-params", type=int, default=d.hostile_params,
                        help="hostile kv_transfer_params per live ticket in each forge round, in [0, 64]")
    parser.add_argument("--no-rival", action="store_true",
                        help="leave out the second consumer and its hostile params")
    parser.add_argument("--read-transport", choices=READ_TRANSPORTS, default=d.read_transport,
                        help="how the consumer reads: auto and mapped put the producer's cache in shared memory and "
                             "copy over the mapping; nixl reads over NIXL (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed (non-negative)")
    add_json_option(parser, "the report as one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hybrid_transfer.soak import SoakSpec, render, run_soak

    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed} must be non-negative", field="seed", value=args.seed)
    check_json_path(args)
    spec = SoakSpec(requests=args.requests, batch=args.batch, model=args.model, max_tokens=args.max_tokens,
                    num_blocks=args.num_blocks, abort_rate=args.abort_rate, stall_rate=args.stall_rate,
                    replay_rate=args.replay_rate, edit_rate=args.edit_rate, lease_s=args.lease,
                    read_deadline_s=args.read_deadline, kills=not args.no_kills, auth=not args.no_auth,
                    rival=not args.no_rival, hostile_params=args.hostile_params, read_transport=args.read_transport,
                    seed=args.seed, log_level=args.log_level.upper()).validate()
    # With the JSON on stdout, the prefill and decode processes (which inherit fd 1) print to stderr.
    with stdout_to_stderr(json_to_stdout(args)):
        report = run_soak(spec, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render(report), file=table_stream(args), flush=True)
    emit_json(args, msgspec.to_builtins(report))
    return 0 if report.ok else 1
