"""`hybrid-transfer layout`: print a model's per-rank cache geometry at one TP size."""

from __future__ import annotations

import argparse

from hybrid_transfer.cli.common import (
    KV_DTYPES,
    add_kv_layout,
    add_model_source,
    load_model,
    parse_kv_dtype,
    parse_kv_layout,
)
from hybrid_transfer.cli.output import add_json_option, check_json_path, emit_json, table_stream
from hybrid_transfer.layout import (
    CacheOptions,
    ModelSpec,
    RankGeometry,
)
from hybrid_transfer.layout.geometry import DEFAULT_ALIGNMENT

_MIB = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "layout",
        help="show the per-rank cache layout of a model at a TP size",
        description=(
            "Per-rank geometry of the paged hybrid cache (docs/layout.md): KV heads, bytes per token per "
            "full-attention layer, conv / ssm bytes per GDN layer, state bytes per request, block size, "
            "page bytes, number of shared tensors and the KV layout. With --json, one JSON object: the figures of "
            "--rank (default: rank 0) at top level and a 'ranks' list of the ranks shown."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_source(parser)
    parser.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size")
    parser.add_argument("--rank", type=int, default=None, metavar="R", help="show only this TP rank; None shows every rank")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=None,
                        help="KV cache dtype; None means the model dtype")
    parser.add_argument("--alignment", type=int, default=DEFAULT_ALIGNMENT, metavar="A",
                        help="block size alignment in tokens for page-size unification")
    parser.add_argument("--kernel-block-size", type=int, default=None, metavar="K",
                        help="attention kernel block size in tokens; None means the logical block size")
    parser.add_argument("--draft-layers", type=int, default=0, metavar="D",
                        help="MTP speculative decoding: the draft module's attention layers, cached after the model's "
                             "(docs/layout.md#draft-layers)")
    parser.add_argument("--speculative-slots", type=int, default=0, metavar="S",
                        help="MTP speculative tokens: each GDN layer's conv window widens from w-1 to w-1+S")
    add_kv_layout(parser)
    add_json_option(parser, "one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_json_path(args)
    model = load_model(args)
    options = CacheOptions(
        kv_dtype=parse_kv_dtype(args.kv_dtype),
        alignment=args.alignment,
        kernel_block_size=args.kernel_block_size,
        kv_layout=parse_kv_layout(args.kv_layout),
        draft_layers=args.draft_layers,
        speculative_slots=args.speculative_slots,
    )
    ranks = rank_figures(model, args.tp, options, args.rank)
    print(render_table(model, ranks), file=table_stream(args))
    emit_json(args, {**ranks[0], "ranks": ranks})
    return 0


def rank_figures(model: ModelSpec, tp_size: int, options: CacheOptions, tp_rank: int | None) -> list[dict]:
    """RankGeometry.describe() of one rank, or of every rank when ``tp_rank`` is None."""
    # Validate TP size and rank once up front: a bad --tp (0, negative) must be a typed error, not an empty list.
    RankGeometry(model, tp_size, 0 if tp_rank is None else tp_rank, options)
    ranks = range(tp_size) if tp_rank is None else [tp_rank]
    figures = []
    for r in ranks:
        d = RankGeometry(model, tp_size, r, options).describe()
        d["state_mib_per_request"] = round(d["state_bytes_per_request"] / _MIB, 2)  # type: ignore[operator]
        figures.append(d)
    return figures


def render_table(model: ModelSpec, ranks: list[dict]) -> str:
    first = ranks[0]
    header = (
        f"{model.name}: {model.num_layers} layers ({first['num_fa_layers']} full attention, "
        f"{first['num_gdn_layers']} GDN), TP {first['tp_size']}, KV {first['kv_dtype']}, "
        f"ssm {first['ssm_dtype']}, KV layout {first['kv_layout']}, conv layout {first['conv_layout']}, "
        f"kernel block {first['kernel_block_size']} (ratio {first['kernel_ratio']})"
    )
    if first.get("draft_layers") or first.get("speculative_slots"):
        header += (f", MTP draft layers {first['draft_layers']}, speculative slots {first['speculative_slots']} "
                   f"(conv window {first['conv_window']})")
    columns = ("rank", "KV heads", "KV B/token/FA layer", "conv B/GDN layer", "ssm B/GDN layer",
               "state B/request", "state MiB", "block tokens", "page B", "tensors")
    rows = [columns]
    for d in ranks:
        lo, hi = d["kv_heads"]
        heads = f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"
        if d["kv_heads_replicated"]:
            heads += " (repl.)"
        rows.append((
            str(d["tp_rank"]), heads, f"{d['kv_bytes_per_token']:,}", f"{d['conv_bytes']:,}",
            f"{d['ssm_bytes']:,}", f"{d['state_bytes_per_request']:,}", f"{d['state_mib_per_request']:.2f}",
            f"{d['block_size']:,}", f"{d['page_bytes']:,}", str(d["num_tensors"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [header, ""]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
