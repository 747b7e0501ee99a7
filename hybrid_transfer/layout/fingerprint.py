"""The fields two engines must agree on before any byte moves (handshake tier one).

Sharding, block sizes and addresses are deliberately absent: those only need
to be compatible, and the planner maps between them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from hybrid_transfer.layout.geometry import TOKEN_MAJOR, RankGeometry


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Unsharded model dimensions, dtypes and layouts; equal on both sides or no transfer."""

    layer_kinds: str  # one letter a layer: 'A' full attention, 'G' GDN
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    kv_dtype: str
    conv_dtype: str
    ssm_dtype: str
    kv_layout: str
    conv_layout: str
    ssm_order: str
    n_minus_one: bool
    layer_tensor: tuple[int, ...]
    kv_interior: str = TOKEN_MAJOR  # protocol 9: kernel pages of another interior mean other bytes per token
    draft_layers: int = 0  # protocol 10: MTP attention layers after the model's (layer_tensor covers them too)
    speculative_slots: int = 0  # protocol 10: the conv window w-1+s, so the state page's bytes

    def digest(self) -> str:
        """A short stable hash, for logs and the handshake envelope."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]


def fingerprint_of(geometry: RankGeometry, *, n_minus_one: bool = True) -> Fingerprint:
    m = geometry.model
    return Fingerprint(
        layer_kinds="".join("A" if k.name == "ATTENTION" else "G" for k in m.layer_kinds),
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
        linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        kv_dtype=geometry.kv_dtype.value,
        conv_dtype=geometry.conv_dtype.value,
        ssm_dtype=geometry.ssm_dtype.value,
        kv_layout=geometry.kv_layout.value,
        conv_layout=geometry.conv_layout.value,
        ssm_order=geometry.ssm_order.value,
        n_minus_one=n_minus_one,
        layer_tensor=geometry.tensor_map.layer_tensor,
        kv_interior=geometry.kv_interior,
        draft_layers=geometry.draft_layers,
        speculative_slots=geometry.speculative_slots,
    )


def fingerprint_diff(ours: Fingerprint, theirs: Fingerprint) -> list[tuple[str, Any, Any]]:
    """Every field that differs, as (name, our value, their value), in declaration order."""
    return [
        (name, getattr(ours, name), getattr(theirs, name))
        for name in ours.__struct_fields__
        if getattr(ours, name) != getattr(theirs, name)
    ]
