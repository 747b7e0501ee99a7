"""An engine that keeps conv state in a dtype other than the model's: peers rebuild it from the handshake."""

from __future__ import annotations

from harness import TINY
from test_transfer import _transfer

from hybrid_transfer.layout import CacheOptions, DType, RankGeometry, model_from_config
from hybrid_transfer.plan.rank import describe_rank, geometry_from_descriptor
from hybrid_transfer.plan.types import PlanMode

# fp32 conv state (the model says bf16) and bf16 ssm state (the model says fp32), as an engine may choose.
ENGINE = CacheOptions(conv_dtype=DType.FP32, ssm_dtype=DType.BF16, block_size=32)


def test_the_descriptor_carries_the_engines_conv_dtype():
    model = model_from_config(TINY, name="tiny")
    geometry = RankGeometry(model, 2, 1, ENGINE)
    desc = describe_rank(geometry, [0x1000, 0x9000], 8)
    assert desc.conv_dtype == "float32"
    rebuilt = geometry_from_descriptor(model, desc)
    assert rebuilt.conv_dtype is DType.FP32 and rebuilt.describe() == geometry.describe()


def test_a_transfer_between_engines_with_an_overridden_conv_dtype_is_bitwise_exact(cluster):
    """2 -> 1 with different block sizes: fan-in reassembles fp32 conv segments from both producer ranks."""
    _transfer(cluster, 2, 1, ENGINE, CacheOptions(conv_dtype=DType.FP32, ssm_dtype=DType.BF16, block_size=64),
              PlanMode.COALESCED, token_counts=[37, 1, 64])
