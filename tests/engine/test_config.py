"""EngineConfig: defaults that work, and every bad field named at start."""

from __future__ import annotations

import msgspec
import pytest

from hybrid_transfer.engine import EngineConfig, ProgressPolicy
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.plan.types import PlanMode


def test_defaults_are_valid_loopback_with_explicit_progress():
    config = EngineConfig().validate()
    assert config.side_channel_host == "127.0.0.1" and config.side_channel_port == 0
    assert config.progress is ProgressPolicy.OFF  # the measured choice (config module docstring)
    assert config.mode is PlanMode.COALESCED


@pytest.mark.parametrize(("field", "value"), [
    ("side_channel_host", ""),
    ("side_channel_port", 70000),
    ("side_channel_port", -1),
    ("handshake_timeout_s", 0),
    ("read_deadline_s", -1.0),
    ("lease_s", float("inf")),
    ("lease_s", float("nan")),
    ("progress_delay_us", -5),
    ("num_backend_threads", -1),
    ("split_batch_size", 0),
    ("staging_bytes", -1),
    ("staging_bytes", 1.5),
    ("read_batching", "per_batch"),
    ("read_batching", None),
])
def test_a_bad_field_is_named_with_its_value(field, value):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value}).validate()
    assert info.value.field == field
    assert field in str(info.value)


def test_config_is_frozen_and_refuses_unknown_fields():
    with pytest.raises(AttributeError):
        EngineConfig().lease_s = 1.0  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError, match="unknown"):
        msgspec.convert({"lease_s": 5.0, "leese_s": 1.0}, EngineConfig)
    assert msgspec.convert({"progress": "on", "progress_delay_us": 100}, EngineConfig).progress is (
        ProgressPolicy.ON_WITH_DELAY)


@pytest.mark.parametrize("mode", [PlanMode.PACK, PlanMode.AUTO])
def test_pack_and_auto_are_executable_and_need_a_staging_pool(mode):
    from hybrid_transfer.engine.config import CostParams

    assert EngineConfig(mode=mode).validate().staging_bytes > 0
    with pytest.raises(ConfigError) as info:
        EngineConfig(mode=mode, staging_bytes=0).validate()
    assert info.value.field == "staging_bytes"
    with pytest.raises(ConfigError) as info:
        EngineConfig(mode=mode, cost=CostParams(per_byte_s=-1.0)).validate()
    assert info.value.field == "cost.per_byte_s"
    assert EngineConfig(staging_bytes=0).validate().mode is PlanMode.COALESCED  # no pool without pack


def test_ucx_thread_pool_defaults_follow_the_memory_kind_and_explicit_values_win():
    from hybrid_transfer.engine.config import GPU_BACKEND_DEFAULTS

    threads, split = GPU_BACKEND_DEFAULTS
    assert EngineConfig().backend_params(True) == {"num_threads": str(threads), "split_batch_size": str(split)}
    assert EngineConfig().backend_params(False) == {}  # host caches: one UCX worker, NIXL's own settings
    assert EngineConfig(num_backend_threads=2, split_batch_size=8).backend_params(False) == {
        "num_threads": "2", "split_batch_size": "8"}
    assert EngineConfig(num_backend_threads=0).backend_params(True) == {}  # no pool: a split size means nothing
    assert EngineConfig(split_batch_size=32).backend_params(True)["split_batch_size"] == "32"


def test_read_batching_defaults_to_per_step_and_takes_per_request_from_a_dict():
    assert EngineConfig().validate().read_batching == "per_step"
    assert EngineConfig.from_dict({"read_batching": "per_request"}).read_batching == "per_request"
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"read_batching": "sometimes"})
    assert info.value.field == "read_batching"
