"""Pure shapes and geometry of the paged hybrid cache (no NIXL, no torch at import)."""

from hybrid_transfer.layout.blocks import kernel_block_ids
from hybrid_transfer.layout.fingerprint import Fingerprint, fingerprint_diff, fingerprint_of
from hybrid_transfer.layout.geometry import (
    CacheOptions,
    ConvLayout,
    ConvSegment,
    KVLayout,
    RankGeometry,
    SsmOrder,
)
from hybrid_transfer.layout.model import DType, LayerKind, ModelSpec, load_config_file, model_from_config
from hybrid_transfer.layout.presets import load_preset, preset_names
from hybrid_transfer.layout.tensor_map import CacheGroup, TensorMap, build_tensor_map

__all__ = [
    "CacheGroup", "CacheOptions", "ConvLayout", "ConvSegment", "DType", "Fingerprint", "KVLayout",
    "LayerKind", "ModelSpec", "RankGeometry", "SsmOrder", "TensorMap", "build_tensor_map",
    "fingerprint_diff", "fingerprint_of", "kernel_block_ids", "load_config_file", "load_preset", "model_from_config",
    "preset_names",
]
