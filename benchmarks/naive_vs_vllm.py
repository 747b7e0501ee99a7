"""Descriptors per READ: vLLM 0.33.0's own NIXL pull worker against our ``naive`` plan, same request.

vLLM's figures come from its real ``NixlPullConnectorWorker`` with a recording NIXL fake
(tests/vllm/naive_helpers.py); ours from the planner in naive mode with vLLM's block and kernel
sizes. One row per (model, prefill TP -> decode TP, tokens, decode rank, source rank). A geometry
vLLM's worker refuses is printed as such, with its error.

Not a test. Run in the vLLM environment (about a minute on 2 cores):

  PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu VLLM_SSM_CONV_STATE_LAYOUT=DS HF_HUB_OFFLINE=1 \\
      $(bash scripts/vllm_env.sh)/bin/python benchmarks/naive_vs_vllm.py
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

import naive_helpers as nh  # noqa: E402

BLOCKS = {nh.TINY: 160, nh.QWEN35_08B: 12}
TOKENS = {nh.TINY: (1, 16, 39, 255, 2047), nh.QWEN35_08B: (1, 543, 545, 2047)}
TP_PAIRS = ((1, 1), (2, 1), (1, 2))
# (label, prefill block size, decode block size): forced logical block sizes, tiny model, TP1 -> TP1
BLOCK_PAIRS = (("B16 -> B32", 16, 32), ("B32 -> B16", 32, 16))
# tiny model only: more prefill ranks than KV heads, and more decode ranks than KV heads
TINY_WIDE_PAIRS = ((4, 1), (1, 4))
REFUSALS: dict[str, str] = {}  # config -> the error vLLM's worker raised


def rows_for(model: str, label: str, prefill: nh.Engine, decode: nh.Engine, tokens: tuple[int, ...]):
    for rank in range(decode.tp_size):
        try:
            pull = nh.VllmPull(prefill, decode, rank)
            per_tokens = [(n, pull.read(n)) for n in tokens]
        except Exception as exc:  # noqa: BLE001 (a refusal is a result here)
            REFUSALS[f"{model}, {label}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            for n in tokens:
                ours = nh.our_naive_reads(model, prefill, decode, n, rank)
                for o in ours:
                    yield (model, label, n, rank, o.source_rank, "refused", o.descriptors, "-", f"{o.nbytes:,}")
            continue
        for n, theirs in per_tokens:
            ours = {o.source_rank: o for o in nh.our_naive_reads(model, prefill, decode, n, rank, pull.kernel_sizes)}
            for t in theirs:
                o = ours.pop(t.source_rank, None)
                yield (model, label, n, rank, t.source_rank, t.descriptors, o.descriptors if o else "-",
                       f"{t.nbytes:,}", f"{o.nbytes:,}" if o else "-")
            for o in ours.values():
                yield (model, label, n, rank, o.source_rank, "-", o.descriptors, "-", f"{o.nbytes:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    logging.disable(logging.WARNING)
    header = ("model", "P -> D", "tokens", "decode rank", "source", "vLLM desc", "naive desc", "vLLM bytes",
              "naive bytes")
    rows = []
    for model, blocks in BLOCKS.items():
        engines = {tp: nh.build_engine(model, tp, blocks) for tp in (1, 2)}
        for p, d in TP_PAIRS:
            rows += rows_for(model, f"TP{p} -> TP{d}", engines[p], engines[d], TOKENS[model])
    wide = {tp: nh.build_engine(nh.TINY, tp, BLOCKS[nh.TINY]) for tp in (1, 4)}
    for p, d in TINY_WIDE_PAIRS:
        rows += rows_for(nh.TINY, f"TP{p} -> TP{d}", wide[p], wide[d], (39,))
    for model, tokens in ((nh.TINY, (39, 255)), (nh.QWEN35_08B, (545, 2047))):
        # a kernel of fixed 16-token blocks under a larger logical block (ratio > 1)
        fixed = nh.build_engine(model, 1, BLOCKS[model], block_size=32, backend=nh.kernel_backend(fixed=16))
        rows += rows_for(model, f"TP1 -> TP1, B{fixed.block_size} kernel 16", fixed, fixed, tokens)
    for label, bp, bd in BLOCK_PAIRS:
        sizes = {b: nh.build_engine(nh.TINY, 1, BLOCKS[nh.TINY], block_size=b) for b in {bp, bd}}
        rows += rows_for(nh.TINY, f"TP1 -> TP1, {label}", sizes[bp], sizes[bd], (39, 255))
    cells = [tuple(str(c) for c in r) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    for config, error in REFUSALS.items():
        print(f"\nrefused: {config}: vLLM 0.33.0's worker has no path there ({error})")


if __name__ == "__main__":
    main()
