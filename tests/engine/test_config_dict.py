"""EngineConfig from plain JSON-like settings (a serving engine's extra config), one side-channel port per rank."""

from __future__ import annotations

import json

import pytest

from hybrid_transfer.engine.config import CostParams, EngineConfig, PrepStrategy, ProgressPolicy
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.plan.types import PlanMode

SETTINGS = {
    "side_channel_host": "10.0.0.7",
    "side_channel_port": 5600,
    "lease_s": 60,
    "heartbeat_interval_s": 2.5,
    "progress": "on",
    "mode": "pack",
    "prep": "prepped",
    "staging_bytes": 1 << 20,
    "cost": {"per_descriptor_s": 1e-5},
    "early_completion_grace_s": 10.0,
}


def test_from_dict_takes_enums_by_value_and_survives_json():
    config = EngineConfig.from_dict(json.loads(json.dumps(SETTINGS)))
    assert config.progress is ProgressPolicy.ON_WITH_DELAY
    assert config.mode is PlanMode.PACK and config.prep is PrepStrategy.PREPPED
    assert config.cost == CostParams(per_descriptor_s=1e-5)
    assert (config.lease_s, config.heartbeat_interval_s, config.early_completion_grace_s) == (60, 2.5, 10.0)
    assert config.side_channel_host == "10.0.0.7"
    assert EngineConfig.from_dict({}) == EngineConfig()


def test_each_tp_rank_binds_base_port_plus_rank():
    ports = [EngineConfig.from_dict(SETTINGS, tp_rank=r).side_channel_port for r in range(4)]
    assert ports == [5600, 5601, 5602, 5603]


def test_port_zero_stays_ephemeral_on_every_rank():
    assert EngineConfig.from_dict({"side_channel_port": 0}, tp_rank=3).side_channel_port == 0


def test_a_base_port_that_overflows_for_a_rank_is_refused():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"side_channel_port": 65535}, tp_rank=1)
    assert info.value.field == "side_channel_port"


@pytest.mark.parametrize("key", ["lease", "kv_layout", "password"])
def test_unknown_keys_are_refused_by_name(key):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"lease_s": 10.0, key: 1})
    assert info.value.field == key and repr(key) in str(info.value)


def test_unknown_cost_keys_are_refused_by_name():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"cost": {"per_descriptor": 1e-6}})
    assert info.value.field == "cost.per_descriptor"


@pytest.mark.parametrize("settings, field", [
    ({"mode": "fast"}, "mode"),
    ({"progress": "OFF"}, "progress"),
    ({"lease_s": "120"}, "lease_s"),
    ({"side_channel_port": "5600"}, "side_channel_port"),
    ({"side_channel_port": True}, "side_channel_port"),
    ({"staging_bytes": 1.5}, "staging_bytes"),
    ({"cost": {"per_byte_s": "x"}}, "cost.per_byte_s"),
    ({"calibrate": 1}, "calibrate"),
    ({"lease_s": -1.0}, "lease_s"),  # typed right, refused by validate()
    ({"side_channel_port": 70000}, "side_channel_port"),
    ({"early_completion_limit": 0}, "early_completion_limit"),
    ({"lease_s": 4.0, "heartbeat_interval_s": 5.0}, "heartbeat_interval_s"),
])
def test_bad_values_are_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(settings)
    assert info.value.field == field


@pytest.mark.parametrize("settings, tp_rank", [(["mode"], 0), ({}, -1), ({}, True)])
def test_bad_arguments_are_refused(settings, tp_rank):
    with pytest.raises(ConfigError):
        EngineConfig.from_dict(settings, tp_rank=tp_rank)
