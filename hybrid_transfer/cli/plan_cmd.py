"""`hybrid-transfer plan`: dry-run the planner for one request between two engines (no memory, no NIXL)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from hybrid_transfer.cli.common import (
    KV_DTYPES,
    add_kv_layout,
    add_model_source,
    check_tokens,
    load_model_and_context,
    non_negative_int,
    parse_kv_dtype,
    parse_kv_layout,
    positive_int,
    token_count,
)
from hybrid_transfer.cli.output import add_json_option, check_json_path, emit_json, table_stream
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import CacheOptions, ModelSpec
from hybrid_transfer.layout.geometry import DEFAULT_ALIGNMENT
from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode, ReadPlan

_POOL_FACTOR = 4  # block pool per side: this many times the blocks a request needs, so shuffles have room


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show the reads each decode rank posts for one request",
        description=(
            "Plan one request from a prefill engine to a decode engine over fake addresses and print, per "
            "decode rank, the source ranks, bytes and descriptors per source, and totals. With --json, a JSON "
            "list: one object per decode rank with decode_rank, total_bytes, descriptors, "
            "sources [{rank, bytes, descriptors, pieces, mode; pack sources also staged_bytes and read_ranges: "
            "the [offset, length] ranges of the source's staging the decode rank READs, as the engine posts "
            "them}], mode, kv_layout, notify, expected_bytes "
            "(what the plan moves) and valid_bytes (the request's payload; naive moves whole pages, so more)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_source(parser)
    parser.add_argument("--prefill-tp", type=positive_int, required=True, metavar="P",
                        help="prefill (producer) TP size")
    parser.add_argument("--decode-tp", type=positive_int, required=True, metavar="D",
                        help="decode (consumer) TP size")
    parser.add_argument("--decode-rank", type=int, default=None, metavar="R",
                        help="plan only this decode rank; None plans every decode rank")
    parser.add_argument("--tokens", type=token_count, required=True, metavar="N",
                        help="tokens whose KV moves (at most the model's max_position_embeddings)")
    parser.add_argument("--mode", choices=[m.value for m in PlanMode], default=PlanMode.COALESCED.value,
                        help="naive (vLLM 0.33's own descriptor scheme: whole pages), coalesced, pack, or auto "
                             "(cost model)")
    parser.add_argument("--fragmentation", type=float, default=0.0, metavar="F",
                        help="share of block ids replaced by random free ids (0: contiguous, 1: shuffled)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed for fragmented block ids")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=None,
                        help="KV cache dtype on both sides; None means the model dtype")
    add_kv_layout(parser)
    parser.add_argument("--alignment", type=int, default=DEFAULT_ALIGNMENT, metavar="A",
                        help="block size alignment in tokens for page-size unification")
    for side in ("prefill", "decode"):
        parser.add_argument(f"--{side}-block-size", type=int, default=None, metavar="B",
                            help=f"{side} logical block size in tokens; None derives it (page-size unification)")
        parser.add_argument(f"--{side}-kernel-block-size", type=int, default=None, metavar="K",
                            help=f"{side} attention kernel block size; None means the logical block size")
    add_json_option(parser, "a JSON list, one object per decode rank")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_json_path(args)
    model, max_tokens = load_model_and_context(args)
    check_tokens(args.tokens, max_tokens, model)
    kv_dtype = parse_kv_dtype(args.kv_dtype)
    kv_layout = parse_kv_layout(args.kv_layout)
    prefill = CacheOptions(kv_dtype=kv_dtype, alignment=args.alignment, block_size=args.prefill_block_size,
                           kernel_block_size=args.prefill_kernel_block_size, kv_layout=kv_layout)
    decode = CacheOptions(kv_dtype=kv_dtype, alignment=args.alignment, block_size=args.decode_block_size,
                          kernel_block_size=args.decode_kernel_block_size, kv_layout=kv_layout)
    plans = plan_all(model, args.prefill_tp, args.decode_tp, prefill, decode, args.tokens, PlanMode(args.mode),
                     args.fragmentation, args.seed, args.decode_rank)
    header = (f"{model.name}: prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, {args.tokens} tokens, "
              f"mode {args.mode}, KV layout {args.kv_layout}, fragmentation {args.fragmentation}")
    print(render_table(header, plans), file=table_stream(args))
    emit_json(args, [plan_summary(p) for p in plans])
    return 0


def plan_all(model: ModelSpec, prefill_tp: int, decode_tp: int, prefill: CacheOptions, decode: CacheOptions,
             num_tokens: int, mode: PlanMode, fragmentation: float, seed: int,
             decode_rank: int | None = None) -> list[ReadPlan]:
    """Plans of one request for every decode rank (or one), over fake engines with block pools to spare."""
    if decode_rank is not None and not 0 <= decode_rank < decode_tp:
        raise ConfigError(f"--decode-rank {decode_rank} is outside [0, {decode_tp})", field="decode_rank",
                          value=decode_rank)
    if num_tokens < 0:
        raise ConfigError(f"--tokens {num_tokens} must be >= 0", field="tokens", value=num_tokens)
    for flag, tp in (("--prefill-tp", prefill_tp), ("--decode-tp", decode_tp)):
        if tp < 1:
            raise ConfigError(f"{flag} {tp} must be >= 1", field=flag.lstrip("-").replace("-", "_"), value=tp)
    if seed < 0:
        raise ConfigError(f"--seed {seed} must be >= 0", field="seed", value=seed)
    rng = np.random.default_rng(seed)
    probe_p = fake_engine(model, prefill_tp, prefill, 1)[0]
    probe_d = fake_engine(model, decode_tp, decode, 1)[0]
    counts_p = blocks_needed(model, probe_p.block_size, num_tokens)
    counts_d = blocks_needed(model, probe_d.block_size, num_tokens)
    pool_p = _POOL_FACTOR * sum(counts_p) + 8
    pool_d = _POOL_FACTOR * sum(counts_d) + 8
    producers = fake_engine(model, prefill_tp, prefill, pool_p, engine_index=0)
    consumers = fake_engine(model, decode_tp, decode, pool_d, engine_index=1)
    remote_ids = make_block_ids(counts_p, pool_p, fragmentation, rng)
    local_ids = make_block_ids(counts_d, pool_d, fragmentation, rng)
    ranks = range(decode_tp) if decode_rank is None else [decode_rank]
    return [plan_request(model, producers, consumers[r], local_ids, remote_ids, num_tokens, mode) for r in ranks]


def plan_request(model: ModelSpec, producers: Sequence[RankDescriptor], consumer: RankDescriptor,
                 local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]], num_tokens: int,
                 mode: PlanMode, cost: CostModel | None = None) -> ReadPlan:
    """One decode rank's plan of one request: the same planner, modes and cost model the consumer engine
    runs, so pack's read ranges (offsets into each source's staging) are the ones it posts."""
    return Planner(model, consumer, producers, cost=cost).plan(local_ids, remote_ids, num_tokens, mode)


def plan_summary(plan: ReadPlan) -> dict:
    """The JSON object of one decode rank."""
    sources = []
    for src in plan.sources:
        sources.append({
            "rank": src.source_rank,
            "bytes": src.total_bytes,
            "descriptors": src.num_descriptors,
            "pieces": src.num_pieces if isinstance(src, PackSourcePlan) else src.num_descriptors,
            "mode": plan.meta.get("source_modes", {}).get(src.source_rank, plan.mode.value),
        })
        if isinstance(src, PackSourcePlan):  # what the engine runs: READ ranges of the source's staging
            sources[-1]["staged_bytes"] = src.staged_bytes
            sources[-1]["read_ranges"] = [[int(o), int(n)] for o, n in zip(src.read.remote_offset.tolist(),
                                                                          src.read.length.tolist(), strict=True)]
    return {
        "decode_rank": plan.decode_rank,
        "mode": plan.mode.value,
        "kv_layout": plan.meta.get("kv_layout"),
        "num_tokens": plan.num_tokens,
        "total_bytes": plan.total_bytes,
        "expected_bytes": plan.expected_bytes,
        "valid_bytes": plan.meta.get("valid_bytes", plan.expected_bytes),
        "descriptors": plan.num_descriptors,
        "sources": sources,
        "notify": [{"rank": n.source_rank, "expected_consumers": n.expected_consumers} for n in plan.notify],
    }


def render_table(header: str, plans: list[ReadPlan]) -> str:
    columns = ("decode rank", "source", "mode", "bytes", "descriptors", "pieces", "notify (rank:expects)")
    rows = [columns]
    for plan in plans:
        s = plan_summary(plan)
        notify = " ".join(f"{n['rank']}:{n['expected_consumers']}" for n in s["notify"])
        for src in s["sources"]:
            rows.append((str(s["decode_rank"]), str(src["rank"]), src["mode"], f"{src['bytes']:,}",
                         f"{src['descriptors']:,}", f"{src['pieces']:,}", ""))
        rows.append((str(s["decode_rank"]), "total", s["mode"], f"{s['total_bytes']:,}", f"{s['descriptors']:,}",
                     "", notify))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [header, ""]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
