"""Global-coordinate oracle for bitwise transfer checks (planner properties, engine tests, bench --verify).

Independent of the planner on purpose: it never sees a descriptor. It knows only which global
coordinates a rank holds (RankGeometry: KV heads, conv channels per Q/K/V segment, value heads) and
where they sit in its views (HybridCache.kv/conv/ssm). A producer rank's blocks get a pattern that is
a function of (seed, layer, kind, global head/channel/value head, token/window position, element)
only, so every consumer rank, whatever its TP size and block size, can be checked against the
pattern at its own coordinates: valid tokens and state hold it, every other byte still holds poison.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError, VerificationError
from hybrid_transfer.layout.geometry import ConvLayout, RankGeometry, SsmOrder
from hybrid_transfer.layout.model import LayerKind

POISON_BYTE = 0xA5

_MASK64 = (1 << 64) - 1
_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# Pattern intermediates are int64: bound them to about 8 MiB per temporary.
_CHUNK_ELEMS = 1 << 20


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


# splitmix64 finalizer constants and a salt for column (element / window / byte) keys.
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_C3 = 0x9E3779B97F4A7C15
_COL_SALT = 0x2545F4914F6CDD1D


class PatternKind(enum.IntEnum):
    """Domain of a pattern value: which half, segment or part of a page it belongs to."""

    K = 1
    V = 2
    CONV_Q = 3
    CONV_K = 4
    CONV_V = 5
    SSM = 6
    PADDING = 7


class RequestLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request's blocks on one engine: ids per cache group (tensor_map.groups order) and its token count.

    ``first_token``: on a consumer, the tokens [0, first_token) it already held (a prefix hit, on a block
    boundary): a correct transfer leaves their blocks untouched."""

    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    first_token: int = 0


# ---- the hash ---------------------------------------------------------------
def _mix_py(x: int) -> int:
    """splitmix64 finalizer on a Python int (the scalar reference of ``_mix``)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * _C1) & _MASK64
    x ^= x >> 27
    x = (x * _C2) & _MASK64
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors; torch int64 multiplication wraps like uint64."""
    x = x ^ _srl(x, 30)
    x = x * _signed64(_C1)
    x = x ^ _srl(x, 27)
    x = x * _signed64(_C2)
    return x ^ _srl(x, 31)


def pattern_base(seed: int, layer: int, kind: PatternKind) -> int:
    """64-bit key of one (seed, layer, kind) domain, as an unsigned Python int."""
    h = _mix_py(seed + _C3)
    h = _mix_py(h + layer + 1)
    return _mix_py(h + int(kind))


def pattern_value(base: int, rows: Sequence[int], col: int, bits: int, poison_byte: int = POISON_BYTE) -> int:
    """Scalar reference of the pattern: the unsigned ``bits``-wide value at row coordinates ``rows``, column ``col``.

    Rows are the outer coordinates (head and token, channel, value head), folded in one at a time;
    the column is the innermost one (element, window position, padding byte).
    """
    key = base
    for r in rows:
        key = _mix_py(key + r)
    x = ((key ^ _mix_py(col + _COL_SALT)) * _C3) & _MASK64
    low_bits = _LOW_BITS[bits // 8]
    return (x >> (64 - bits)) & ~low_bits | (0 if poison_byte & 1 else low_bits)


def _row_keys(base: int, index: torch.Tensor) -> torch.Tensor:
    return _mix(index + _signed64(base))


_SIGNED_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_LOW_BITS = {1: 0x01, 2: 0x0101, 4: 0x01010101}  # bit 0 of every byte


def _cells(rows: torch.Tensor, num_cols: int, itemsize: int, poison_byte: int) -> torch.Tensor:
    """Pattern values [*rows.shape, num_cols] in the integer dtype of ``itemsize``.

    Bit 0 of every byte is forced to the opposite of the poison byte's, so no pattern byte can pass
    for an untouched one (it costs one bit per byte; a byte compare per lane cost 3x the whole hash).
    The oracle's hot loop: three int64 passes and two narrow ones per element.
    """
    cols = _mix(torch.arange(num_cols, dtype=torch.int64, device=rows.device) + _COL_SALT)
    x = rows.unsqueeze(-1) ^ cols
    x *= _signed64(_C3)
    x >>= 64 - 8 * itemsize  # arithmetic shift: the top bits, already in the signed range of the target
    out = x.to(_SIGNED_DTYPES[itemsize])
    low_bits = _LOW_BITS[itemsize]
    out &= ~low_bits  # ~ of a positive int is negative: the same bits in the signed dtype
    if not poison_byte & 1:
        out |= low_bits
    return out.view(_INT_DTYPES[itemsize])


def _arange(r: range, device: torch.device) -> torch.Tensor:
    return torch.arange(r.start, r.stop, dtype=torch.int64, device=device)


def _kv_head_keys(seed: int, layer: int, heads: range, device: torch.device) -> torch.Tensor:
    """[2 (K, V), heads] row keys before the token is folded in."""
    h = _arange(heads, device)
    return torch.stack([_row_keys(pattern_base(seed, layer, kind), h) for kind in (PatternKind.K, PatternKind.V)])


def kv_pattern(seed: int, layer: int, heads: range, tokens: range, head_dim: int, itemsize: int,
               poison_byte: int = POISON_BYTE, device: torch.device | str = "cpu") -> torch.Tensor:
    """[2 (K, V), len(heads), len(tokens), head_dim] pattern at global heads and request token positions."""
    device = torch.device(device)
    keys = _kv_head_keys(seed, layer, heads, device)
    rows = _mix(keys.unsqueeze(-1) + _arange(tokens, device))
    return _cells(rows, head_dim, itemsize, poison_byte)


def conv_pattern(seed: int, layer: int, segment: int, channels: range, window: int, itemsize: int,
                 poison_byte: int = POISON_BYTE, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(channels), window] pattern at global channels of conv segment 0/1/2 (Q/K/V)."""
    base = pattern_base(seed, layer, PatternKind(PatternKind.CONV_Q + segment))
    return _cells(_row_keys(base, _arange(channels, torch.device(device))), window, itemsize, poison_byte)


def ssm_pattern(seed: int, layer: int, value_heads: range, dv: int, dk: int, itemsize: int,
                poison_byte: int = POISON_BYTE, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(value_heads), dv, dk] pattern at global value heads (element index = i_dv * dk + i_dk)."""
    rows = _row_keys(pattern_base(seed, layer, PatternKind.SSM), _arange(value_heads, torch.device(device)))
    return _cells(rows, dv * dk, itemsize, poison_byte).view(len(value_heads), dv, dk)


# ---- requests -----------------------------------------------------------------
def _check_request(cache: HybridCache, request: RequestLayout) -> None:
    """Ids per group as the request model says, in range and unique: the oracle is wrong otherwise."""
    g = cache.geometry
    groups = g.tensor_map.groups
    n = request.num_tokens
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"num_tokens={n!r} must be a non-negative integer", field="num_tokens", value=n)
    if len(request.block_ids) != len(groups):
        raise ConfigError(f"request lists {len(request.block_ids)} groups, the cache has {len(groups)}",
                          field="block_ids", value=request.block_ids)
    first = request.first_token
    if not isinstance(first, int) or not 0 <= first <= n or first % g.block_size:
        raise ConfigError(f"first_token={first!r} must be a multiple of the block size {g.block_size} in "
                          f"[0, num_tokens={n}]", field="first_token", value=first)
    need = g.num_blocks_for_tokens(n)
    for index, (group, ids) in enumerate(zip(groups, request.block_ids, strict=True)):
        if group.kind is LayerKind.ATTENTION and len(ids) < need:
            raise ConfigError(f"attention group {index} lists {len(ids)} blocks, {n} tokens need {need}",
                              field="block_ids", value=ids)
        if group.kind is LayerKind.GDN and len(ids) != 1:
            raise ConfigError(f"GDN group {index} lists {len(ids)} blocks, exactly 1 expected",
                              field="block_ids", value=ids)
        for b in ids:
            if not isinstance(b, (int, np.integer)) or not 0 <= b < cache.num_blocks:
                raise ConfigError(f"block id {b!r} of group {index} out of range [0, {cache.num_blocks})",
                                  field="block_ids", value=b)
    _check_unique(g, [request])


def _check_unique(g: RankGeometry, requests: Sequence[RequestLayout]) -> None:
    """No block written twice; a prefix hit's attention blocks are not written, and requests may share them."""
    seen: set[int] = set()
    repeated: set[int] = set()
    for request in requests:
        hit = request.first_token // g.block_size
        for group, ids in zip(g.tensor_map.groups, request.block_ids, strict=True):
            for b in ids[hit:] if group.kind is LayerKind.ATTENTION else ids:
                (repeated if b in seen else seen).add(b)
    if repeated:
        raise ConfigError(f"block ids repeat across groups or requests: {sorted(repeated)}", field="block_ids",
                          value=sorted(repeated))


def make_requests(geometry: RankGeometry, token_counts: Sequence[int], num_blocks_total: int,
                  rng: np.random.Generator | int | None = None, fragmentation: float = 0.0,
                  extra_local_blocks: int = 0) -> list[RequestLayout]:
    """Non-overlapping requests, one per token count, drawing distinct ids from ``num_blocks_total`` blocks.

    Each attention group gets ceil(n / block_size) + ``extra_local_blocks`` ids, each GDN group one.
    With fragmentation 0 all ids form one ascending run (at a random start); otherwise that fraction
    of positions gets ids drawn at random from the rest of the pool, in random order (1.0: a random
    permutation of a random sample).

    Raises:
        ConfigError: bad counts or fraction, or the pool is too small.
    """
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if not 0.0 <= fragmentation <= 1.0:
        raise ConfigError(f"fragmentation={fragmentation} must be in [0, 1]", field="fragmentation",
                          value=fragmentation)
    if extra_local_blocks < 0:
        raise ConfigError(f"extra_local_blocks={extra_local_blocks} must be >= 0", field="extra_local_blocks",
                          value=extra_local_blocks)
    for n in token_counts:
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ConfigError(f"num_tokens={n!r} must be a non-negative integer", field="num_tokens", value=n)
    groups = geometry.tensor_map.groups
    sizes = [
        [geometry.num_blocks_for_tokens(int(n)) + extra_local_blocks if g.kind is LayerKind.ATTENTION else 1
         for g in groups]
        for n in token_counts
    ]
    total = sum(map(sum, sizes))
    if total > num_blocks_total:
        raise ConfigError(f"requests need {total} blocks, the pool holds {num_blocks_total}",
                          field="num_blocks_total", value=num_blocks_total)
    start = int(gen.integers(0, num_blocks_total - total + 1))
    ids = np.arange(start, start + total, dtype=np.int64)
    num_moved = math.floor(fragmentation * total + 0.5)
    if num_moved:
        moved = gen.choice(total, size=num_moved, replace=False)
        kept = np.delete(ids, moved)
        free = np.setdiff1d(np.arange(num_blocks_total, dtype=np.int64), kept)
        ids[moved] = gen.choice(free, size=num_moved, replace=False)
    requests, pos = [], 0
    for n, per_group in zip(token_counts, sizes, strict=True):
        block_ids = []
        for count in per_group:
            block_ids.append(tuple(int(b) for b in ids[pos : pos + count]))
            pos += count
        requests.append(RequestLayout(block_ids=tuple(block_ids), num_tokens=int(n)))
    return requests


def make_request(geometry: RankGeometry, num_tokens: int, num_blocks_total: int,
                 rng: np.random.Generator | int | None = None, fragmentation: float = 0.0,
                 extra_local_blocks: int = 0) -> RequestLayout:
    """One request's block ids; see make_requests."""
    return make_requests(geometry, [num_tokens], num_blocks_total, rng, fragmentation, extra_local_blocks)[0]


# ---- writing the pattern through views ------------------------------------------
def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The same elements as integers, so 16-bit and fp8 patterns survive bit-exactly."""
    return t.view(_INT_DTYPES[t.element_size()])


def _write_attention(cache: HybridCache, layer: int, block_ids: Sequence[int], num_tokens: int, seed: int,
                     poison_byte: int, first_token: int = 0) -> None:
    """Pattern for request tokens [first_token, num_tokens) of one layer, token t at block t // B, position t % B
    (``first_token``: a multiple of B).

    Written through the layout-free ``k`` / ``v`` views, so the oracle is the same for every KV layout.
    """
    g = cache.geometry
    bs, kbs, ratio = g.block_size, g.kernel_block_size, g.kernel_ratio
    heads, hd, item = g.kv_heads, g.model.head_dim, g.kv_itemsize
    nh = len(heads)
    halves = [_int_view(cache.k(layer)).view(cache.num_blocks, ratio, nh, kbs, hd),
              _int_view(cache.v(layer)).view(cache.num_blocks, ratio, nh, kbs, hd)]
    device = halves[0].device
    num_full, rem = divmod(num_tokens, bs)
    keys = _kv_head_keys(seed, layer, heads, device).view(2, 1, 1, nh, 1)
    step = max(1, _CHUNK_ELEMS // (2 * nh * bs * hd))
    for i0 in range(first_token // bs, num_full, step):
        i1 = min(num_full, i0 + step)
        # Rows in page order [K/V, block, kernel block, head, token]: no permuted copy afterwards.
        tokens = torch.arange(i0 * bs, i1 * bs, dtype=torch.int64, device=device).view(i1 - i0, ratio, 1, kbs)
        pat = _cells(_mix(keys + tokens), hd, item, poison_byte)
        ids = block_ids[i0:i1]
        for half, view in enumerate(halves):
            if list(ids) == list(range(ids[0], ids[0] + len(ids))):
                view[ids[0] : ids[0] + len(ids)] = pat[half]
            else:
                view[torch.tensor(ids, dtype=torch.int64, device=device)] = pat[half]
    if rem:
        pat = kv_pattern(seed, layer, heads, range(num_full * bs, num_tokens), hd, item, poison_byte, device)
        whole, part = divmod(rem, kbs)
        for half, view in enumerate(halves):
            page = view[block_ids[num_full]]  # [ratio, heads, kbs, head_dim]
            if whole:
                page[:whole] = pat[half, :, : whole * kbs].reshape(nh, whole, kbs, hd).transpose(0, 1)
            if part:
                page[whole, :, :part] = pat[half, :, whole * kbs :]


def _write_state(cache: HybridCache, layer: int, block_id: int, seed: int, poison_byte: int) -> None:
    """Conv (each segment at its global channels) and ssm (at global value heads) of one state block."""
    g = cache.geometry
    m = g.model
    conv = _int_view(cache.conv(layer))[block_id]  # [conv_dim_local, w-1+s], a strided view in SD
    for segment, channels in enumerate(g.conv_channel_ranges):
        lo = g.conv_segment_channel_offsets[segment]
        conv[lo : lo + len(channels)] = conv_pattern(seed, layer, segment, channels, g.conv_window,
                                                     g.conv_itemsize, poison_byte, conv.device)
    pat = ssm_pattern(seed, layer, g.value_heads, m.linear_value_head_dim, m.linear_key_head_dim,
                      g.ssm_dtype.itemsize, poison_byte, conv.device)
    ssm = _int_view(cache.ssm(layer))
    ssm[block_id] = pat if g.ssm_order is SsmOrder.V_D_K else pat.transpose(1, 2)


def _write_padding(cache: HybridCache, tensor_index: int, block_id: int, seed: int, poison_byte: int) -> None:
    """Source side only: padding must never reach a consumer, so its bytes need only differ from poison."""
    g = cache.geometry
    page = cache.raw(tensor_index)[block_id]
    rows = _row_keys(pattern_base(seed, tensor_index, PatternKind.PADDING),
                     torch.tensor([block_id], dtype=torch.int64, device=page.device))
    page[g.state_page_bytes :] = _cells(rows, g.page_bytes - g.state_page_bytes, 1, poison_byte)[0]


def _write_unused(cache: HybridCache, tensor_index: int, block_ids: Sequence[int], seed: int,
                  poison_byte: int) -> None:
    """Source side only: a padded group's pages on a tensor where it has no layer hold no cache, so a consumer
    must never receive them; a pattern that differs from poison makes a plan that moves them fail the check."""
    if not block_ids:
        return
    raw = cache.raw(tensor_index)
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=raw.device)
    rows = _row_keys(pattern_base(seed, cache.geometry.num_tensors + tensor_index, PatternKind.PADDING), ids)
    raw[ids] = _cells(rows, cache.geometry.page_bytes, 1, poison_byte)


def poison(cache: HybridCache, byte: int = POISON_BYTE) -> None:
    """Fill every byte of every shared tensor with ``byte``."""
    if not 0 <= byte <= 0xFF:
        raise ConfigError(f"poison byte {byte!r} must be in [0, 255]", field="poison_byte", value=byte)
    for t in cache.tensors:
        t.fill_(byte)


def fill_source(cache: HybridCache, request: RequestLayout, seed: int, poison_byte: int = POISON_BYTE) -> None:
    """Write the pattern into every block ``request`` holds on this producer rank.

    Attention: every token of every listed block, tails past num_tokens included (a correct transfer
    leaves them behind). State: conv, ssm, and a distinct pattern in the page padding. A padded group's
    pages on tensors where it has no layer get a distinct pattern too (they must never move). The pattern
    depends on ``poison_byte``: pass the same one to the destination check.
    """
    _check_request(cache, request)
    g = cache.geometry
    for group, ids in zip(g.tensor_map.groups, request.block_ids, strict=True):
        for tensor_index, layer in enumerate(group.layers):
            if group.kind is LayerKind.ATTENTION:
                _write_attention(cache, layer, ids, len(ids) * g.block_size, seed, poison_byte)
            else:
                _write_state(cache, layer, ids[0], seed, poison_byte)
                _write_padding(cache, tensor_index, ids[0], seed, poison_byte)
        for tensor_index in range(len(group.layers), g.num_tensors):  # a padded group's empty slots
            _write_unused(cache, tensor_index, ids, seed, poison_byte)


def expected_destination_many(cache_like: HybridCache, requests: Sequence[tuple[RequestLayout, int]],
                              poison_byte: int = POISON_BYTE) -> list[torch.Tensor]:
    """Raw bytes of every shared tensor of a consumer rank after correct transfers of (request, seed) pairs.

    Poison everywhere except, per request, valid tokens (first_token <= t < num_tokens; on an interior that is not
    token-major, every token of a kernel page holding one: docs/attention-layouts.md) at this rank's KV heads and,
    when num_tokens > 0, the state at this rank's conv channels and value heads. Padding stays poison.
    """
    g = cache_like.geometry
    for request, _ in requests:
        _check_request(cache_like, request)
    _check_unique(g, [r for r, _ in requests])
    clone = HybridCache.allocate(g, cache_like.num_blocks, device=cache_like.device)
    poison(clone, poison_byte)
    for request, seed in requests:
        for group, ids in zip(g.tensor_map.groups, request.block_ids, strict=True):
            for layer in group.layers:
                if group.kind is LayerKind.ATTENTION:  # a partial kernel page of an opaque interior moves whole
                    _write_attention(clone, layer, ids, g.moved_token_end(request.num_tokens), seed, poison_byte,
                                     request.first_token)
                elif request.num_tokens > 0:
                    _write_state(clone, layer, ids[0], seed, poison_byte)
    return clone.tensors


def expected_destination(cache_like: HybridCache, request: RequestLayout, seed: int,
                         poison_byte: int = POISON_BYTE) -> list[torch.Tensor]:
    """expected_destination_many for one request."""
    return expected_destination_many(cache_like, [(request, seed)], poison_byte)


def _copy_attention_tails(dst: HybridCache, src: HybridCache, requests: Sequence[RequestLayout]) -> None:
    """Copy, from ``src`` into ``dst``, the unused tail of each request's last attention page (tokens n..page end)."""
    g = dst.geometry
    bs, kbs, ratio = g.block_size, g.kernel_block_size, g.kernel_ratio
    for request in requests:
        n = request.num_tokens
        need = g.num_blocks_for_tokens(n)
        first = n - (need - 1) * bs if need else bs  # first tail position inside the last page
        if first >= bs:
            continue
        for group, ids in zip(g.tensor_map.groups, request.block_ids, strict=True):
            if group.kind is not LayerKind.ATTENTION:
                continue
            block = ids[need - 1]
            for layer in group.layers:
                for half in (0, 1):
                    view_d, view_s = (_int_view(c.k(layer) if half == 0 else c.v(layer)).view(
                        c.num_blocks, ratio, g.num_kv_heads_local, kbs, g.model.head_dim) for c in (dst, src))
                    for kidx in range(first // kbs, ratio):
                        start = max(first - kidx * kbs, 0)
                        view_d[block, kidx, :, start:] = view_s[block, kidx, :, start:]


def check_destination_many(cache: HybridCache, requests: Sequence[tuple[RequestLayout, int]],
                           poison_byte: int = POISON_BYTE, *, skip_attention_tails: bool = False) -> None:
    """Compare every byte of ``cache`` with expected_destination_many.

    ``skip_attention_tails``: ignore the unused tail of each request's last attention page. Only
    for naive plans, which move whole pages like vLLM; every other mode must leave it poison.

    Raises:
        VerificationError: some byte differs; it names the first one, decoded, and counts them all.
    """
    expected = expected_destination_many(cache, requests, poison_byte)
    if skip_attention_tails:
        _copy_attention_tails(HybridCache.wrap(cache.geometry, expected), cache, [r for r, _ in requests])
    first: tuple[int, int] | None = None
    num_bad = 0
    for index, (actual, want) in enumerate(zip(cache.tensors, expected, strict=True)):
        if torch.equal(actual, want):
            continue
        bad = actual != want
        num_bad += int(bad.sum())
        if first is None:
            first = (index, int(bad.to(torch.uint8).argmax()))
    if first is None:
        return
    index, offset = first
    block_id, location = describe_byte(cache.geometry, [r for r, _ in requests], index, offset)
    want_byte, got_byte = int(expected[index][offset]), int(cache.tensors[index][offset])
    raise VerificationError(
        f"{num_bad} bad byte(s); first at tensor {index} offset {offset}: {location}: "
        f"expected 0x{want_byte:02x}, found 0x{got_byte:02x}",
        tensor_index=index, first_bad_offset=offset, num_bad_bytes=num_bad, block_id=block_id,
        location=location, expected_byte=want_byte, actual_byte=got_byte,
    )


def check_destination(cache: HybridCache, request: RequestLayout, seed: int, poison_byte: int = POISON_BYTE, *,
                      skip_attention_tails: bool = False) -> None:
    """check_destination_many for one request."""
    check_destination_many(cache, [(request, seed)], poison_byte, skip_attention_tails=skip_attention_tails)


# ---- decoding a byte for error messages -------------------------------------------
def describe_byte(geometry: RankGeometry, requests: Sequence[RequestLayout], tensor_index: int,
                  offset: int) -> tuple[int, str]:
    """(block id, what the byte at ``offset`` of shared tensor ``tensor_index`` is) for a human."""
    g = geometry
    block_id, in_page = divmod(offset, g.page_bytes)
    for r_index, request in enumerate(requests):
        for group, ids in zip(g.tensor_map.groups, request.block_ids, strict=True):
            if block_id not in ids:
                continue
            if tensor_index >= len(group.layers):
                return block_id, (f"block {block_id} (request {r_index}) on tensor {tensor_index}, where its padded "
                                  f"group holds no layer, page byte {in_page}")
            layer = group.layers[tensor_index]
            where = f"block {block_id} (request {r_index}, layer {layer})"
            if group.kind is LayerKind.ATTENTION:
                return block_id, f"{where}: " + _describe_kv(g, in_page, ids.index(block_id), request.num_tokens)
            return block_id, f"{where}: " + _describe_state(g, in_page)
    return block_id, f"block {block_id} (held by no request), page byte {in_page}"


def _describe_kv(g: RankGeometry, in_page: int, list_index: int, num_tokens: int) -> str:
    kernel, rest = divmod(in_page, g.kernel_block_bytes)
    if g.is_interleaved:
        slot, rest = divmod(rest, g.kv_head_stride)
        tok, rest = divmod(rest, g.kv_token_stride)
        half, rest = divmod(rest, g.head_token_bytes)
    else:
        half, rest = divmod(rest, g.kv_half_bytes)
        slot, rest = divmod(rest, g.kv_head_stride)
        tok, rest = divmod(rest, g.kv_token_stride)
    elem, byte = divmod(rest, g.kv_itemsize)
    token = list_index * g.block_size + kernel * g.kernel_block_size + tok
    state = "valid" if token < num_tokens else f"tail, past num_tokens={num_tokens}"
    return (f"attention {'KV'[half]} byte, global head {g.kv_heads[slot]}, token {token} ({state}), "
            f"kernel block {kernel}, element {elem} byte {byte}")


def _describe_state(g: RankGeometry, in_page: int) -> str:
    m = g.model
    if in_page < g.conv_bytes:
        idx, byte = divmod(in_page, g.conv_itemsize)
        if g.conv_layout is ConvLayout.DS:
            channel, pos = divmod(idx, g.conv_window)
        else:
            pos, channel = divmod(idx, g.conv_dim_local)
        segment = max(s for s in range(3) if g.conv_segment_channel_offsets[s] <= channel)
        global_channel = g.conv_channel_ranges[segment][channel - g.conv_segment_channel_offsets[segment]]
        return (f"conv byte, segment {'QKV'[segment]} global channel {global_channel}, window position {pos}, "
                f"byte {byte}")
    if in_page < g.state_page_bytes:
        idx, byte = divmod(in_page - g.conv_bytes, g.ssm_dtype.itemsize)
        slot, idx = divmod(idx, m.linear_value_head_dim * m.linear_key_head_dim)
        inner = m.linear_key_head_dim if g.ssm_order is SsmOrder.V_D_K else m.linear_value_head_dim
        a, b = divmod(idx, inner)
        axes = "dv, dk" if g.ssm_order is SsmOrder.V_D_K else "dk, dv"
        return f"ssm byte, global value head {g.value_heads[slot]}, ({axes}) = ({a}, {b}), byte {byte}"
    return f"state page padding, page byte {in_page}"
