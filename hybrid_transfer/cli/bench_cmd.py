"""`hybrid-transfer bench`: real transfers between rank processes; GB/s against naive and the ceiling."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from hybrid_transfer.bench.spec import DEFAULT_SWEEP_VALUES, KV_DTYPES, BenchSpec, Device, Sweep
from hybrid_transfer.cli.common import check_output_path
from hybrid_transfer.cli.output import (
    add_json_option,
    emit_json,
    json_path,
    json_to_stdout,
    stdout_to_stderr,
    table_stream,
)
from hybrid_transfer.engine.config import READ_BATCHING, READ_TRANSPORTS
from hybrid_transfer.layout import KVLayout, preset_names
from hybrid_transfer.plan.types import PlanMode

_DEFAULTS = BenchSpec()
CPU_ROUNDS = 3  # --rounds on cpu when not given
TABLE_WIDTH = 100  # the default summary's width on a pipe or file (--wide: WIDE_WIDTH)
WIDE_WIDTH = 200


def _number_list(cast, kind: str):
    """An argparse type for a comma-separated list of ``cast`` values."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(cast(v) for v in text.split(",") if v.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind}") from exc
        if not values:
            raise argparse.ArgumentTypeError("the list is empty")
        return values

    return parse


_int_list = _number_list(int, "integers")
_float_list = _number_list(float, "numbers")


def register(subparsers: argparse._SubParsersAction) -> None:
    d = _DEFAULTS
    parser = subparsers.add_parser(
        "bench",
        help="measure transfers between real rank processes: GB/s, descriptors, latency, vs naive and ceiling",
        description=(
            "Spawns one process per prefill rank and per decode rank, each with its own NIXL agent (UCX), and "
            "moves model-shaped requests (paged KV of every attention layer + GDN state) through the engine. "
            "Every run measures, on the same requests: the chosen --mode, the naive mode (vLLM 0.33's own "
            "scheme: one descriptor per shared tensor and kernel page, whole pages) and the ceiling (one READ "
            "of the same bytes per (decode rank, source) as a single descriptor, between the same processes). "
            "GB/s counts the valid payload bytes for every variant (naive's page tails are not counted). "
            "Prints a summary table (on stderr when --json has no path); --json gives the figures, --plot draws them."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", default=d.preset, metavar="NAME",
                        help=f"model preset: {', '.join(preset_names())}")
    parser.add_argument("--prefill-tp", type=int, default=d.prefill_tp, metavar="P",
                        help="prefill (producer) TP size: P rank processes")
    parser.add_argument("--decode-tp", type=int, default=d.decode_tp, metavar="D",
                        help="decode (consumer) TP size: D rank processes")
    parser.add_argument("--tokens", type=int, default=d.tokens, metavar="N",
                        help="tokens per request whose KV moves (the GDN state moves too when N > 0)")
    parser.add_argument("--requests", type=int, default=d.requests, metavar="R",
                        help="timed requests per variant; each has its own blocks on both sides, so the caches "
                             "hold R requests (a token sweep sizes each point's caches to its tokens, the same R at "
                             "every point, so its largest point decides what fits). Long contexts: every request costs its bytes up to six times over (prefill "
                             "and decode caches, --verify's expected copy, the ceiling and copy buffers); qwen3.5-"
                             "397b-a17b P2 -> D8 at 131072 tokens is ~19 GB per request summed over ranks, so one "
                             "H200 (all ranks on GPU 0) fits --requests 1 with --verify (about 75 GiB coalesced, "
                             "94 GiB pack), 2 coalesced without it. The bench refuses a count that cannot fit, before "
                             "allocating, and names the count that would")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, metavar="C",
                        help="requests in flight per decode rank")
    parser.add_argument("--fragmentation", type=float, default=d.fragmentation, metavar="F",
                        help="share of block ids replaced by random ones, both sides (0: contiguous, 1: shuffled)")
    parser.add_argument("--mode", choices=[m.value for m in PlanMode], default=d.mode.value,
                        help="plan mode measured beside naive, the ceiling and the copy: coalesced (merge "
                             "contiguous ranges), naive, pack (gather / one READ / scatter) or auto (cost model); "
                             "pack and auto are also measured against coalesced in the same run")
    parser.add_argument("--device", choices=[x.value for x in Device], default=d.device.value,
                        help="where caches live: cpu (DRAM) or cuda (each rank on its GPU; needs "
                             "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, set for the ranks when unset)")
    parser.add_argument("--prefill-gpus", type=_int_list, default=",".join(map(str, d.prefill_gpus)), metavar="LIST",
                        help="cuda: GPU indices for prefill ranks, round-robin (e.g. 0)")
    parser.add_argument("--decode-gpus", type=_int_list, default=",".join(map(str, d.decode_gpus)), metavar="LIST",
                        help="cuda: GPU indices for decode ranks, round-robin (e.g. 1 or 0,1)")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=None,
                        help="KV cache dtype on both sides; None means the model dtype")
    parser.add_argument("--kv-layout", choices=[m.value for m in KVLayout], default=d.kv_layout,
                        help="attention page layout of both sides: interleaved [heads][tokens][K|V] (vLLM 0.33) "
                             "or split [K | V] halves (older vLLM)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of block ids and byte patterns")
    parser.add_argument("--backend-threads", type=int, default=d.backend_threads, metavar="N",
                        help="threads of UCX's thread-pool engine per NIXL agent (0: one worker, no pool); "
                        "None means the engine's default for the cache's memory (EngineConfig)")
    parser.add_argument("--split-batch-size", type=int, default=d.split_batch_size, metavar="N",
                        help="descriptors per UCX thread-pool task; None means the engine's default")
    parser.add_argument("--post-thread", choices=["on", "off"], default=None,
                        help="decode ranks create and post their READs on a second thread (on) or on their own "
                        "thread (off); default: the engine's (off: measured, it did not help on one H200, "
                        "docs/tuning.md#posting-thread)")
    parser.add_argument("--verify", action="store_true",
                        help="fill sources with the global-coordinate pattern and check every byte of every "
                             "decode cache after each variant (outside the timed window)")
    parser.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                        help="untimed requests per variant before the timed ones (first READs wire up UCX; with "
                             "pack on CPU use at least --concurrency, so the consumer's new staging pool is "
                             "paged in before timing)")
    parser.add_argument("--rounds", type=int, default=None, metavar="K",
                        help=f"timed rounds of every variant, interleaved (the order rotates each round); figures "
                             f"come from each variant's median-GB/s round, every round's GB/s is in the JSON "
                             f"(gbps_rounds). None means {CPU_ROUNDS} on cpu (a shared host's noise) and "
                             f"{d.rounds} on cuda")
    parser.add_argument("--per-step", type=int, default=None, metavar="N",
                        help="decode steps: up to N requests start together in one Consumer.start_reads call, as "
                             "vLLM's worker starts a step's loads (1..--concurrency); None means --concurrency")
    parser.add_argument("--read-batching", choices=list(READ_BATCHING), default=d.read_batching,
                        help="EngineConfig.read_batching of the decode ranks: per_step posts one READ and one "
                             "Claims per producer agent per start_reads call, per_request each request alone "
                             "(docs/lifecycle.md#batched-reads)")
    parser.add_argument("--read-transport", choices=list(READ_TRANSPORTS), default=d.read_transport,
                        help="nixl: every variant reads over NIXL. auto or mapped: also time the mapped path "
                             "(variants mapped, and mapped-auto with --mode auto: one copy call per step over a "
                             "mapping of the producer's cache, same host only) beside the NIXL variants; every "
                             "rank then gets a fresh shared secret (docs/tuning.md#mapped-reads)")
    parser.add_argument("--wide", action="store_true",
                        help="print every column and the time-split table (about 190 columns); the default "
                             "summary fits 100")
    parser.add_argument("--sweep", choices=[s.value for s in Sweep if s is not Sweep.NONE], default=None,
                        help="run every variant at several fragmentations or token counts")
    parser.add_argument("--sweep-values", type=_float_list, default=None, metavar="LIST",
                        help="comma-separated values for --sweep; None means "
                             + "; ".join(f"{k}: {','.join(str(v) for v in vs)}"
                                         for k, vs in DEFAULT_SWEEP_VALUES.items()))
    add_json_option(parser, "the figures as one JSON object (a sweep lists its points)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH",
                        help="write a PNG of GB/s: against the swept value, or bars without --sweep; --sweep tokens "
                             "adds READ descriptors per decode rank and plan ms per request (log token axis)")
    parser.add_argument("--allocation", choices=BenchSpec.ALLOCATIONS, default=d.allocation,
                        help="how block ids are drawn on each side: fragmentation (--fragmentation's share of "
                             "random ids) or vllm-pool (vLLM 0.33's shared block pool after a churn of requests of "
                             "0.8-1.0 x --tokens, twice --requests live; docs/benchmarks.md#vllm-pool)")
    parser.add_argument("--transport", choices=["shm", "tcp"], default=d.transport,
                        help="shm: UCX's own choice on one host (shared memory); tcp: every rank's UCX limited to "
                             "TCP on the first non-loopback interface, the path between hosts without RDMA "
                             "(CPU only; docs/between-hosts.md)")
    parser.add_argument("--peer", choices=["vllm-nixl"], default=None,
                        help="also run vLLM 0.33's own NixlConnector beside ours over the same caches and requests "
                             "(P1 -> D1, CPU; --concurrency requests per decode step); needs the vLLM environment's "
                             "python (docs/benchmarks.md#vllm-nixl)")
    parser.set_defaults(handler=run)


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    return BenchSpec(
        allocation=args.allocation,
        preset=args.preset, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, tokens=args.tokens,
        requests=args.requests, concurrency=args.concurrency, fragmentation=args.fragmentation,
        mode=PlanMode(args.mode), device=Device(args.device), prefill_gpus=tuple(args.prefill_gpus),
        decode_gpus=tuple(args.decode_gpus), kv_dtype=args.kv_dtype, seed=args.seed, verify=args.verify,
        warmup=args.warmup, rounds=default_rounds(args.device) if args.rounds is None else args.rounds, sweep=Sweep(args.sweep) if args.sweep else Sweep.NONE,
        sweep_values=tuple(args.sweep_values or ()), backend_threads=args.backend_threads,
        split_batch_size=args.split_batch_size,
        post_thread=None if args.post_thread is None else args.post_thread == "on",
        kv_layout=args.kv_layout, transport=args.transport, per_step=args.per_step,
        read_batching=args.read_batching, read_transport=args.read_transport,
    ).validate()


def default_rounds(device: str) -> int:
    """--rounds when not given: CPU_ROUNDS on cpu (a shared host's noise moves one round), else the spec's."""
    return CPU_ROUNDS if device == Device.CPU.value else BenchSpec().rounds


def run(args: argparse.Namespace) -> int:
    if args.rounds is None:
        args.rounds = default_rounds(args.device)
    if args.peer is not None:
        from hybrid_transfer.cli.peer_run import run_peer

        return run_peer(args)
    from hybrid_transfer.bench.coordinator import Coordinator
    from hybrid_transfer.bench.plot import write_plot
    from hybrid_transfer.bench.report import plain_table, print_table, to_json

    spec = spec_from_args(args)
    for flag, path in (("--json", json_path(args)), ("--plot", args.plot)):
        if path is not None:
            check_output_path(path, flag)  # before the run, not after it
    coordinator = Coordinator(spec)
    has_rich = importlib.util.find_spec("rich") is not None  # the bench extra; bare GPU images may lack it
    # With the JSON on stdout, the rank processes (which inherit fd 1) and NIXL print to stderr instead.
    with stdout_to_stderr(json_to_stdout(args)):
        if has_rich and sys.stderr.isatty():
            result = _run_with_progress(coordinator)
        else:  # a pipe or a file: one plain line per step, so a long run shows it is alive
            coordinator.on_step = ProgressLines(coordinator.num_steps, sys.stderr)
            result = coordinator.run()
    table = table_stream(args)
    if has_rich:
        from rich.console import Console

        # A terminal gets its own width; a pipe or file the summary's (or --wide's).
        width = None if table.isatty() else WIDE_WIDTH if args.wide else TABLE_WIDTH
        print_table(result, Console(file=table, width=width), wide=args.wide)
    else:
        print(plain_table(result, wide=args.wide), file=table)
    emit_json(args, to_json(result))
    if args.plot is not None:
        write_plot(result, args.plot)
    return 0


class ProgressLines:
    """Coordinator.on_step for a stderr that is not a terminal: ``[k/n] elapsed s  description`` per step."""

    def __init__(self, total: int, stream):
        self.total, self.stream, self.done = total, stream, 0
        self.t0 = time.monotonic()

    def __call__(self, description: str) -> None:
        self.done += 1
        print(f"bench [{self.done}/{self.total}] {time.monotonic() - self.t0:6.1f} s  {description}",
              file=self.stream, flush=True)


def _run_with_progress(coordinator):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting rank processes", total=coordinator.num_steps)

        def step(description: str) -> None:
            progress.update(task, advance=1, description=description)

        coordinator.on_step = step
        return coordinator.run()
