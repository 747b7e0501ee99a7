"""A short tour of the layout registry and HybridCache (CPU only, a few seconds).

Run from the repository root: .venv/bin/python examples/layout_tour.py
(`bash scripts/setup.sh` creates .venv)
"""

from __future__ import annotations

import sys

try:
    import torch

    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.layout import CacheOptions, ConvSegment, RankGeometry, fingerprint_of, load_preset
except ModuleNotFoundError as exc:  # a Python without the project's packages (not .venv's)
    sys.exit(f"{exc.name} is not installed for {sys.executable}; run: "
             "bash scripts/setup.sh && .venv/bin/python examples/layout_tour.py")

MIB = 1 << 20

model = load_preset("qwen3.5-397b-a17b")
print(f"{model.name}: {len(model.attention_layers)} attention + {len(model.gdn_layers)} GDN layers")

# 1. Geometry per TP size: heads, state bytes and the block size that page-size unification picks.
for tp in (1, 2, 4, 8):
    g = RankGeometry(model, tp, tp_rank=tp - 1)
    print(
        f"TP{tp} rank {tp - 1}: KV heads {list(g.kv_heads)}, {g.kv_bytes_per_token} B/token/layer, "
        f"state {g.state_bytes_per_request / MIB:.2f} MiB/request, block {g.block_size} tokens, "
        f"page {g.page_bytes:,} B"
    )

# 2. The layer-to-tensor map: layers 4j..4j+3 share tensor j.
g = RankGeometry(model, 8, tp_rank=5, options=CacheOptions(kernel_block_size=16))
print("tensor of layers 0..7:", [g.tensor_of(i) for i in range(8)])

# 3. A real cache: 15 shared tensors of 2 pages each; typed views per layer alias the same pages.
cache = HybridCache.allocate(g, num_blocks=2)
kv = cache.kv(3)  # attention layer 3 lives on tensor 0; interleaved: [kernel blocks, heads, tokens, K|V]
conv, ssm = cache.conv(0), cache.ssm(0)  # GDN layer 0 lives on tensor 0 too
print("kv(3)", tuple(kv.shape), kv.dtype, "| k(3)", tuple(cache.k(3).shape), "| conv(0)", tuple(conv.shape),
      "| ssm(0)", tuple(ssm.shape))
print(f"kernel blocks per logical block: {g.kernel_ratio}")

# Write a state through the GDN view and find it at the byte range the cache reports.
ssm[1].fill_(1.5)
addr, length = cache.ssm_range(0, block_id=1)
raw = cache.raw(0).reshape(-1)
offset = addr - cache.regions[0].addr
print(f"ssm of block 1: bytes [{offset:,}, {offset + length:,}) of tensor 0,",
      "all 1.5:", bool((raw[offset : offset + length].view(torch.float32) == 1.5).all()))
addr, length = cache.conv_range(0, 1, ConvSegment.V)
print(f"conv V segment of block 1: {length:,} bytes at offset {addr - cache.regions[0].addr:,}")

# Block 1 of the GDN group and block 1 of the attention group are the same page: that is why a block id
# belongs to one group at a time.
print("kv(3) block 1 now sees the state bytes:", bool(kv[1 * g.kernel_ratio :].count_nonzero() > 0))

# 4. The handshake fingerprint ignores TP and block size but not layouts or dtypes.
print("fingerprint at TP8:", fingerprint_of(g).digest(), "at TP1:", fingerprint_of(RankGeometry(model, 1)).digest())
