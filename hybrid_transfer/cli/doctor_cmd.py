"""`hybrid-transfer doctor`: check NIXL, UCX and this host the way the engine will use them, and say how to fix."""

from __future__ import annotations

import argparse
import re
import sys

import msgspec

from hybrid_transfer.cli.output import add_json_option, check_json_path, emit_json, stdout_to_stderr, table_stream
from hybrid_transfer.doctor import (
    DEFAULT_NUM_BYTES,
    MIN_NUM_BYTES,
    CheckResult,
    Device,
    DoctorOptions,
    DoctorReport,
    Status,
    render,
    run_doctor,
)
from hybrid_transfer.doctor.host import engine_side_channel_defaults

__all__ = ["parse_size", "register", "render", "run"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64MiB', '64M', '1g', '4096' -> bytes (K, M, G, T are powers of 1024); multiple of 8, >= 4 KiB."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 16M, 64MiB or 1G")
    num_bytes = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if num_bytes < MIN_NUM_BYTES or num_bytes % 8:
        raise argparse.ArgumentTypeError(f"{text!r} = {num_bytes} B: must be a multiple of 8 and at least "
                                         f"{MIN_NUM_BYTES} B")
    return num_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    host, port = engine_side_channel_defaults()
    parser = subparsers.add_parser(
        "doctor",
        help="check NIXL, UCX transports, loopback transfers and host settings; explain fixes",
        description=(
            "Runs these checks, each pass / warn / fail with the fix: nixl (importable, version, which build: "
            "nixl-cu12 / nixl-cu13), ucx_backend (an agent with UCX can be created; plugins found), transports "
            "(the transport UCX really selects for a READ, read from its UCX_PROTO_INFO tables), loopback_dram "
            "and loopback_vram (a one-descriptor READ between two processes, bytes verified, GB/s), "
            "cuda_ipc_read (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, without which GPU bytes silently go over TCP), "
            "side_channel_port (the handshake port can be bound), progress_thread (CPU that NIXL's progress "
            "thread burns while idle). Exit code 0 when no check fails, 1 otherwise. With --json, one JSON "
            'document: {"checks": [{"name", "status", "detail", "fix", "data"}], "ok": bool}.'
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_json_option(parser, "one JSON document")
    parser.add_argument("--device", choices=[d.value for d in Device], default=Device.AUTO.value,
                        help="cpu: DRAM checks only; cuda: DRAM and GPU (VRAM) checks, failing without a GPU; "
                             "auto: cuda when torch sees a GPU")
    parser.add_argument("--host", default=None,
                        help=f"side-channel host to bind; None means the engine's default ({host})")
    parser.add_argument("--port", type=int, default=None, metavar="N",
                        help=f"side-channel port to check; None means the engine's default ({port}; 0 = the "
                             "producer picks a free port at start)")
    parser.add_argument("--bytes", type=parse_size, default=DEFAULT_NUM_BYTES, metavar="SIZE", dest="num_bytes",
                        help="bytes of each loopback READ (one descriptor); K/M/G suffixes are powers of 1024")
    link = parser.add_argument_group(
        "between two hosts",
        "`doctor --serve --host ADDR` on one host and `doctor --peer ADDR:PORT` on the other measure READ bandwidth "
        "and 8-byte latency between them through NIXL's agent and name the transports UCX picked "
        "(docs/between-hosts.md#doctor-peer). With a secret set (HYBRID_TRANSFER_SECRET or --secret-file) on the "
        "server, a peer must prove the same secret")
    roles = link.add_mutually_exclusive_group()
    roles.add_argument("--serve", action="store_true",
                       help="serve one peer on --host (required) and --port (default 5599; 0 picks a free one), "
                            "then exit; exit 1 when no peer finished within --timeout")
    roles.add_argument("--peer", metavar="HOST:PORT", default=None, help="READ from a --serve on another host")
    link.add_argument("--timeout", type=float, default=60.0, metavar="S",
                      help="--serve: give up after S seconds without a finished peer; --peer: the whole exchange")
    link.add_argument("--secret-file", default=None, metavar="PATH",
                      help="read the shared secret from PATH instead of $HYBRID_TRANSFER_SECRET")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_json_path(args)
    if args.serve or args.peer:
        return _run_link(args)
    options = DoctorOptions(device=Device(args.device), host=args.host, port=args.port,
                            num_bytes=args.num_bytes).validate()
    progress = _print_progress if sys.stderr.isatty() else None
    with stdout_to_stderr():  # UCX and NIXL's Python logger print to stdout while the checks run
        report = run_doctor(options, on_check=progress)
    print(render(report), file=table_stream(args))
    emit_json(args, report.to_builtins())
    return 0 if report.ok else 1


def _run_link(args: argparse.Namespace) -> int:
    from hybrid_transfer.doctor.host import check_nixl_import
    from hybrid_transfer.doctor.link import LinkOptions, peer, serve
    from hybrid_transfer.doctor.link_wire import DEFAULT_LINK_PORT, parse_peer_address
    from hybrid_transfer.engine.auth import load_secret

    secret = load_secret(args.secret_file)
    if args.serve:
        options = LinkOptions(host=args.host or "", port=DEFAULT_LINK_PORT if args.port is None else args.port,
                              timeout_s=args.timeout, num_bytes=args.num_bytes, secret=secret).validate()
    else:
        host, port = parse_peer_address(args.peer)
        options = LinkOptions(host=host, port=port, timeout_s=args.timeout, secret=secret)
    with stdout_to_stderr():  # UCX and NIXL's Python logger print to stdout
        if args.peer:
            report = peer(options)  # imports NIXL only once the server accepted it
        elif (nixl := check_nixl_import()).status is not Status.PASS:
            report = DoctorReport(checks=(nixl,))
        else:
            options = msgspec.structs.replace(options, api_module=nixl.data["api_module"])
            report = serve(options, on_listen=_print_listening)
    print(render(report), file=table_stream(args))
    emit_json(args, report.to_builtins())
    return 0 if report.ok else 1


def _print_listening(host: str, port: int) -> None:
    shown = f"[{host}]" if ":" in host else host  # what --peer takes on the other host
    print(f"doctor --serve: listening on {shown}:{port}", file=sys.stderr, flush=True)


def _print_progress(result: CheckResult) -> None:
    print(f"  {result.name}: {result.status.value}", file=sys.stderr, flush=True)
