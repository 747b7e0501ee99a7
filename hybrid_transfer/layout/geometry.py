"""Per-rank geometry: what one TP rank holds and where it sits inside a page.

Pure arithmetic over a ModelSpec (docs/sharding.md, docs/layout.md#pages). Every byte offset the
planner and the cache use comes from here, so the two can never disagree.
"""

from __future__ import annotations

import enum
import math
import numbers
from functools import cached_property

import msgspec

from hybrid_transfer.errors import ConfigError, ShardingError
from hybrid_transfer.layout.model import DType, LayerKind, ModelSpec
from hybrid_transfer.layout.tensor_map import TensorMap, build_tensor_map

DEFAULT_ALIGNMENT = 16  # FlashAttention's smallest kernel block


class ConvLayout(enum.Enum):
    """Conv state order inside a page. DS: channels outer (a channel range is one byte range)."""

    DS = "DS"
    SD = "SD"


class SsmOrder(enum.Enum):
    """Axis order of one recurrent-state head (both are head-major, so head ranges are contiguous)."""

    V_D_K = "nv,dv,dk"  # current vLLM order
    V_K_D = "nv,dk,dv"  # vLLM before PR #33291


class KVLayout(enum.Enum):
    """Byte order of an attention kernel block (docs/layout.md, "Attention pages").

    INTERLEAVED: ``[heads][tokens][K|V]``, the flash-attn shape ``[blocks, heads, tokens, 2*head_dim]``
    that vLLM 0.33 allocates for every attention backend (its ``LBHNC``, which vLLM also calls ``HND``).
    SPLIT: ``[K | V]`` halves, each ``[heads][tokens][head_dim]``: older vLLM.
    Neither name is ``HND``: vLLM uses that for the interleaved order, this project once used it for split.
    """

    SPLIT = "split"
    INTERLEAVED = "interleaved"


class ConvSegment(enum.IntEnum):
    Q = 0
    K = 1
    V = 2


TOKEN_MAJOR = "token-major"
MAX_INTERIOR_CHARS = 64


def check_kv_interior(value: object) -> str:
    """A page-interior name: TOKEN_MAJOR or a kernel's name (printable ASCII, at most 64 characters).

    Raises:
        ConfigError: anything else, named (a peer's descriptor carries this value).
    """
    if not isinstance(value, str) or not 0 < len(value) <= MAX_INTERIOR_CHARS or not value.isascii() \
            or not value.isprintable():
        raise ConfigError(f"kv_interior={value!r} must be {TOKEN_MAJOR!r} or a kernel name of 1-{MAX_INTERIOR_CHARS} "
                          "printable ASCII characters", field="kv_interior", value=value)
    return value


class CacheOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a serving engine lays out its cache; defaults match vLLM 0.33 with DS conv state.

    block_size: logical block size in tokens; None derives it by page-size
    unification (docs/layout.md). kernel_block_size: None means equal to block_size
    (ratio 1, as vLLM 0.33 with FlashAttention). Plain strings ("DS", "fp8", "split")
    are accepted and coerced to the enums; anything else raises ConfigError naming it,
    because an unchecked string would silently take the wrong branch of a view.
    """

    kv_dtype: DType | None = None  # None: the model dtype
    ssm_dtype: DType | None = None  # None: the model's mamba_ssm_dtype
    alignment: int = DEFAULT_ALIGNMENT
    block_size: int | None = None
    kernel_block_size: int | None = None
    conv_layout: ConvLayout = ConvLayout.DS
    ssm_order: SsmOrder = SsmOrder.V_D_K
    kv_layout: KVLayout = KVLayout.INTERLEAVED
    conv_dtype: DType | None = None  # None: the model dtype (an engine may keep conv state in another)
    # How an attention kernel orders the bytes of one head's [tokens x K|V] chunk of a kernel block
    # (docs/attention-layouts.md#page-interiors): TOKEN_MAJOR, or the name of a kernel whose order is not
    # known to be token-major (its kernel pages then move whole, never split by token).
    kv_interior: str = TOKEN_MAJOR
    # MTP speculative decoding (docs/layout.md#draft-layers): attention layers of the draft module cached after the
    # model's (cached layer num_layers + i), and the speculative tokens s that widen each conv window to w-1+s.
    draft_layers: int = 0
    speculative_slots: int = 0

    def __post_init__(self) -> None:
        check_kv_interior(self.kv_interior)
        for name in ("draft_layers", "speculative_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a non-negative integer", field=name, value=value)
            if type(value) is not int:
                msgspec.structs.force_setattr(self, name, int(value))
        for name in ("kv_dtype", "ssm_dtype", "conv_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, DType):
                if not isinstance(value, str):
                    raise ConfigError(f"{name}={value!r} must be a dtype name or DType", field=name, value=value)
                msgspec.structs.force_setattr(self, name, DType.parse(value, field=name))
        for name, enum_type in (("conv_layout", ConvLayout), ("ssm_order", SsmOrder), ("kv_layout", KVLayout)):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                msgspec.structs.force_setattr(self, name, _coerce_enum(enum_type, name, value))
        for name in ("alignment", "block_size", "kernel_block_size"):
            value = getattr(self, name)
            if value is None and name != "alignment":
                continue
            # bool is an int subclass: True would silently mean a block of one token.
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{name}={value!r} must be an integer", field=name, value=value)
            if type(value) is not int:  # numpy integers: plain ints keep msgspec encoding and hashing simple
                msgspec.structs.force_setattr(self, name, int(value))


def _coerce_enum(enum_type: type[enum.Enum], name: str, value: object) -> enum.Enum:
    """Member of ``enum_type`` whose value or name equals ``value`` (case-insensitive for strings)."""
    if isinstance(value, str):
        for member in enum_type:
            if value in (member.value, member.name) or value.lower() in (member.value.lower(), member.name.lower()):
                return member
    choices = ", ".join(repr(m.value) for m in enum_type)
    hint = ""
    if enum_type is KVLayout and isinstance(value, str) and value.upper() in ("HND", "LBHNC"):
        hint = " (vLLM 0.33 calls its interleaved [heads][tokens][K|V] order HND / LBHNC: use 'interleaved')"
    raise ConfigError(f"{name}={value!r} is not one of {choices}{hint}", field=name, value=value)


class RankGeometry:
    """Shapes, shards and byte offsets of one TP rank's paged hybrid cache.

    Offsets are relative to the start of a shared tensor; a block's page starts
    at ``block_id * page_bytes``.
    """

    def __init__(self, model: ModelSpec, tp_size: int, tp_rank: int = 0, options: CacheOptions | None = None):
        self.model = model
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.options = options or CacheOptions()
        _check_sharding(model, tp_size, tp_rank)
        self.kv_dtype = self.options.kv_dtype or model.dtype
        self.conv_dtype = self.options.conv_dtype or model.dtype
        self.ssm_dtype = self.options.ssm_dtype or model.ssm_dtype
        self.conv_layout = self.options.conv_layout
        self.ssm_order = self.options.ssm_order
        self.kv_layout = self.options.kv_layout
        self.kv_interior = self.options.kv_interior
        self.draft_layers = self.options.draft_layers
        self.speculative_slots = self.options.speculative_slots
        self.tensor_map: TensorMap = build_tensor_map(model, self.draft_layers)
        self._check_block_sizes()

    # ---- attention ---------------------------------------------------------
    @property
    def kv_heads_replicated(self) -> bool:
        return self.tp_size > self.model.num_kv_heads

    @property
    def num_kv_heads_local(self) -> int:
        return max(1, self.model.num_kv_heads // self.tp_size)

    @property
    def first_kv_head(self) -> int:
        """Global index of this rank's first KV head (docs/sharding.md#kv-heads)."""
        k, t, r = self.model.num_kv_heads, self.tp_size, self.tp_rank
        return r * k // t if t > k else r * (k // t)

    @property
    def kv_heads(self) -> range:
        return range(self.first_kv_head, self.first_kv_head + self.num_kv_heads_local)

    @property
    def kv_itemsize(self) -> int:
        return self.kv_dtype.itemsize

    @property
    def head_token_bytes(self) -> int:
        """Bytes of one head's one token in one K or V half."""
        return self.model.head_dim * self.kv_itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in one full-attention layer (attn_1tok)."""
        return 2 * self.num_kv_heads_local * self.head_token_bytes

    @property
    def num_attention_layers(self) -> int:
        """Cached attention layers: the model's plus the draft layers."""
        return len(self.model.attention_layers) + self.draft_layers

    def cached_layers(self) -> tuple[tuple[int, LayerKind], ...]:
        """Every cached layer with its kind: the model's layers, then the draft layers (``num_layers + i``)."""
        return self.tensor_map.cached_layers()

    def layer_kind(self, layer: int) -> LayerKind:
        """Kind of a cached layer (draft layers included).

        Raises:
            ConfigError: no such cached layer.
        """
        kinds = self.tensor_map.layer_kinds
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < len(kinds):
            raise ConfigError(f"layer={layer!r} out of range [0, {len(kinds)})", field="layer", value=layer)
        return kinds[layer]

    # ---- GDN state ---------------------------------------------------------
    @property
    def has_gdn(self) -> bool:
        return bool(self.model.gdn_layers)

    @property
    def conv_window(self) -> int:
        """Stored conv positions per channel: w-1, plus the speculative slots (only [0, w-1) is read when
        decoding starts; the rest is scratch, moved whole since both sides have the same s)."""
        return self.model.conv_window + self.speculative_slots

    @cached_property
    def conv_channel_ranges(self) -> tuple[range, range, range]:
        """Global channel index ranges of this rank's Q, K and V conv segments (each within its own segment)."""
        if not self.has_gdn:
            return (range(0), range(0), range(0))
        m, t, r = self.model, self.tp_size, self.tp_rank
        qk = m.linear_num_key_heads * m.linear_key_head_dim // t
        v = m.linear_num_value_heads * m.linear_value_head_dim // t
        return (range(r * qk, (r + 1) * qk), range(r * qk, (r + 1) * qk), range(r * v, (r + 1) * v))

    @property
    def conv_dim_local(self) -> int:
        return sum(len(c) for c in self.conv_channel_ranges)

    @property
    def conv_itemsize(self) -> int:
        return self.conv_dtype.itemsize

    @cached_property
    def conv_segment_channel_offsets(self) -> tuple[int, int, int]:
        """Local channel index where Q, K and V start inside [Q_r | K_r | V_r]."""
        q, k, _ = (len(c) for c in self.conv_channel_ranges)
        return (0, q, q + k)

    @cached_property
    def conv_segment_bytes(self) -> tuple[int, int, int]:
        """s0, s1, s2: bytes of the local Q, K and V conv segments."""
        w = self.conv_window
        return tuple(len(c) * w * self.conv_itemsize for c in self.conv_channel_ranges)  # type: ignore[return-value]

    @property
    def conv_bytes(self) -> int:
        return self.conv_dim_local * self.conv_window * self.conv_itemsize

    @property
    def value_heads(self) -> range:
        """Global value heads of this rank's recurrent state."""
        if not self.has_gdn:
            return range(0)
        n = self.model.linear_num_value_heads // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    @property
    def ssm_head_bytes(self) -> int:
        m = self.model
        return m.linear_value_head_dim * m.linear_key_head_dim * self.ssm_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        return len(self.value_heads) * self.ssm_head_bytes

    @property
    def state_page_bytes(self) -> int:
        """Real bytes of one GDN layer's state: conv then ssm (padding excluded)."""
        return self.conv_bytes + self.ssm_bytes

    @property
    def state_bytes_per_request(self) -> int:
        return len(self.model.gdn_layers) * self.state_page_bytes

    # ---- pages and blocks --------------------------------------------------
    @cached_property
    def block_size(self) -> int:
        """Logical block size in tokens (docs/layout.md#page-size-unification)."""
        if self.options.block_size is not None:
            return self.options.block_size
        a, tok = self.options.alignment, self.kv_bytes_per_token
        return a * max(1, math.ceil(self.state_page_bytes / (a * tok)))

    @property
    def kernel_block_size(self) -> int:
        # `is None`, not `or`: an explicit 0 must reach the check in _check_block_sizes, not mean "default".
        kbs = self.options.kernel_block_size
        return self.block_size if kbs is None else kbs

    @property
    def kernel_ratio(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def kernel_block_bytes(self) -> int:
        """One [K|V] pair of one kernel block."""
        return self.kernel_block_size * self.kv_bytes_per_token

    @property
    def kv_half_bytes(self) -> int:
        """K (or V) bytes of one kernel block: heads_local x kernel_block_size x head_dim (one range only in split)."""
        return self.kernel_block_bytes // 2

    @property
    def is_interleaved(self) -> bool:
        return self.kv_layout is KVLayout.INTERLEAVED

    @property
    def is_token_major(self) -> bool:
        """A token's K|V bytes sit where kv_layout says inside a kernel page (docs/attention-layouts.md#page-interiors)."""
        return self.kv_interior == TOKEN_MAJOR

    def moved_token_end(self, num_tokens: int) -> int:
        """Where a request's moved attention bytes end, in tokens: ``num_tokens`` on a token-major interior;
        else the end of the kernel page holding the last token, so a partial kernel page moves whole."""
        if self.is_token_major or num_tokens <= 0:
            return num_tokens
        return -(-num_tokens // self.kernel_block_size) * self.kernel_block_size

    @property
    def kv_token_stride(self) -> int:
        """Bytes from one token to the next inside a head: K|V of a token in interleaved, K (or V) in split."""
        return 2 * self.head_token_bytes if self.is_interleaved else self.head_token_bytes

    @property
    def kv_head_stride(self) -> int:
        """Bytes from one head slot to the next inside a kernel block (the K half's heads in split)."""
        return self.kernel_block_size * self.kv_token_stride

    @property
    def kv_half_stride(self) -> int:
        """Bytes from K to V of the same (head, token): a whole half in split, one head_dim in interleaved."""
        return self.head_token_bytes if self.is_interleaved else self.kv_half_bytes

    @property
    def kv_halves_per_run(self) -> int:
        """Halves one contiguous token run of a head carries: 2 (K|V) in interleaved, 1 in split."""
        return 2 if self.is_interleaved else 1

    @property
    def num_tensors(self) -> int:
        return self.tensor_map.num_tensors

    def tensor_of(self, layer: int) -> int:
        return self.tensor_map.tensor_of(layer)

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- byte offsets inside a shared tensor ------------------------------
    def kv_offset(self, block_id: int, kernel_index: int, half: int, head_slot: int = 0, token: int = 0) -> int:
        """Offset of (K if half == 0 else V, local head slot, token) inside a kernel block of a page.

        split: ``half * kv_half_bytes + (head_slot * kernel_block_size + token) * head_token_bytes``;
        interleaved: ``((head_slot * kernel_block_size + token) * 2 + half) * head_token_bytes``.
        """
        return (
            block_id * self.page_bytes
            + kernel_index * self.kernel_block_bytes
            + half * self.kv_half_stride
            + head_slot * self.kv_head_stride
            + token * self.kv_token_stride
        )

    def conv_segment_offset(self, block_id: int, segment: ConvSegment) -> int:
        """Offset of a DS conv segment inside a page (SD has no single range per segment)."""
        if self.conv_layout is not ConvLayout.DS:
            raise ConfigError("conv segments are one byte range only in DS layout", field="conv_layout",
                              value=self.conv_layout.value)
        return block_id * self.page_bytes + sum(self.conv_segment_bytes[: int(segment)])

    def ssm_offset(self, block_id: int) -> int:
        return block_id * self.page_bytes + self.conv_bytes

    def describe(self) -> dict[str, object]:
        """The per-rank figures `hybrid-transfer layout` prints."""
        return {
            "preset": self.model.name,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "kv_dtype": self.kv_dtype.value,
            "ssm_dtype": self.ssm_dtype.value,
            "kv_heads": [self.kv_heads.start, self.kv_heads.stop],
            "kv_heads_replicated": self.kv_heads_replicated,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_all_layers": self.kv_bytes_per_token * self.num_attention_layers,
            "conv_dim_local": self.conv_dim_local,
            "conv_segment_bytes": list(self.conv_segment_bytes),
            "conv_bytes": self.conv_bytes,
            "ssm_bytes": self.ssm_bytes,
            "state_page_bytes": self.state_page_bytes,
            "state_bytes_per_request": self.state_bytes_per_request,
            "block_size": self.block_size,
            "kernel_block_size": self.kernel_block_size,
            "kernel_ratio": self.kernel_ratio,
            "page_bytes": self.page_bytes,
            "padding_bytes_per_state_page": self.page_bytes - self.state_page_bytes if self.has_gdn else 0,
            "num_tensors": self.num_tensors,
            "num_fa_layers": len(self.model.attention_layers),
            "num_gdn_layers": len(self.model.gdn_layers),
            "conv_layout": self.conv_layout.value,
            "kv_layout": self.kv_layout.value,
            "kv_interior": self.kv_interior,
            **({"draft_layers": self.draft_layers, "speculative_slots": self.speculative_slots,
                "conv_window": self.conv_window} if self.draft_layers or self.speculative_slots else {}),
        }

    def __repr__(self) -> str:
        return (f"RankGeometry({self.model.name}, tp={self.tp_rank}/{self.tp_size}, block_size={self.block_size}, "
                f"kv_layout={self.kv_layout.value})")

    def _check_block_sizes(self) -> None:
        o = self.options
        if o.alignment <= 0:
            raise ConfigError(f"alignment={o.alignment} must be positive", field="alignment", value=o.alignment)
        if o.block_size is not None and o.block_size <= 0:
            raise ConfigError(f"block_size={o.block_size} must be positive", field="block_size", value=o.block_size)
        kbs = self.kernel_block_size
        if kbs <= 0 or self.block_size % kbs:
            raise ConfigError(
                f"kernel_block_size={kbs} must be positive and divide block_size={self.block_size}",
                field="kernel_block_size",
                value=kbs,
            )
        if self.has_gdn and self.page_bytes < self.state_page_bytes:
            raise ConfigError(
                f"block_size={self.block_size} gives page_bytes={self.page_bytes}, too small for the "
                f"{self.state_page_bytes}-byte GDN state page",
                field="block_size",
                value=self.block_size,
            )
        if self.has_gdn and self.page_bytes % max(self.ssm_dtype.itemsize, self.conv_itemsize):
            # Typed views step from page to page; a page size that is not a whole number of
            # state elements cannot be viewed as conv / ssm arrays.
            raise ConfigError(
                f"block_size={self.block_size} gives page_bytes={self.page_bytes}, not a whole number of "
                f"{self.conv_dtype.value} conv / {self.ssm_dtype.value} ssm elements",
                field="block_size",
                value=self.block_size,
            )
        if self.has_gdn and self.conv_bytes % self.ssm_dtype.itemsize:
            raise ConfigError(
                f"conv_bytes={self.conv_bytes} leaves the ssm state misaligned for {self.ssm_dtype.value}",
                field="conv_bytes",
                value=self.conv_bytes,
            )


def _check_sharding(model: ModelSpec, tp_size: int, tp_rank: int) -> None:
    if not isinstance(tp_size, int) or tp_size <= 0:
        raise ShardingError(f"tp_size={tp_size!r} must be a positive integer", field="tp_size", value=tp_size)
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ShardingError(f"tp_rank={tp_rank!r} must be in [0, {tp_size})", field="tp_rank", value=tp_rank)
    k = model.num_kv_heads
    if (tp_size <= k and k % tp_size) or (tp_size > k and tp_size % k):
        raise ShardingError(
            f"tp_size={tp_size} cannot shard num_key_value_heads={k} (one must divide the other)",
            field="tp_size",
            value=tp_size,
        )
    if model.gdn_layers:
        for field in ("linear_num_key_heads", "linear_num_value_heads"):
            heads = getattr(model, field)
            if heads % tp_size:
                raise ShardingError(
                    f"tp_size={tp_size} does not divide {field}={heads}", field="tp_size", value=tp_size
                )
