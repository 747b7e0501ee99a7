"""EngineConfig.from_dict per rank of data-parallel engines: the port rule and where advertise_host comes from.

One ``kv_connector_extra_config`` reaches every rank of every DP engine of an endpoint (docs/dep.md),
so each rank's port and advertised host are derived from it here.
"""

from __future__ import annotations

import itertools

import pytest

from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.errors import ConfigError


@pytest.mark.parametrize(("dp_size", "tp_size"), [(2, 1), (2, 2), (8, 1), (3, 4)])
def test_every_rank_of_every_dp_engine_binds_its_own_port_from_one_base(dp_size, tp_size):
    base = 5600
    ports = {(dp, tp): EngineConfig.from_dict({"side_channel_port": base}, tp_rank=tp, tp_size=tp_size,
                                              dp_index=dp).side_channel_port
             for dp, tp in itertools.product(range(dp_size), range(tp_size))}
    assert len(set(ports.values())) == dp_size * tp_size  # no two ranks collide
    assert sorted(ports.values()) == list(range(base, base + dp_size * tp_size))  # a dense block above the base
    for (dp, tp), port in ports.items():
        assert port == base + dp * tp_size + tp


def test_port_zero_stays_pick_a_free_port_on_every_rank():
    assert EngineConfig.from_dict({"side_channel_port": 0}, tp_rank=1, tp_size=2, dp_index=7).side_channel_port == 0


def test_dp_index_zero_keeps_the_tp_only_rule():
    assert EngineConfig.from_dict({"side_channel_port": 5600}, tp_rank=3).side_channel_port == 5603
    assert EngineConfig.from_dict({"side_channel_port": 5600}, tp_rank=1, tp_size=2).side_channel_port == 5601


def test_a_rank_port_above_65535_is_refused_naming_the_values():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"side_channel_port": 65530}, tp_rank=1, tp_size=2, dp_index=3)
    assert info.value.field == "side_channel_port" and info.value.value == 65530
    message = str(info.value)
    assert "65530" in message and "data_parallel_index 3" in message and "tp_size 2" in message
    assert "tp_rank 1" in message and "65537" in message


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"tp_rank": 2, "tp_size": 2}, "tp_size"),  # tp_rank must be below tp_size
    ({"tp_rank": 0, "tp_size": 0}, "tp_size"),
    ({"tp_rank": 0, "tp_size": True}, "tp_size"),
    ({"tp_rank": 0, "dp_index": 1}, "tp_size"),  # a DP offset needs the TP size
    ({"tp_rank": 0, "tp_size": 1, "dp_index": -1}, "dp_index"),
    ({"tp_rank": 0, "tp_size": 1, "dp_index": 1.0}, "dp_index"),
    ({"tp_rank": -1, "tp_size": 1}, "tp_rank"),
])
def test_bad_rank_arguments_are_refused_naming_them(kwargs, field):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"side_channel_port": 5600}, **kwargs)
    assert info.value.field == field
    from hybrid_transfer.engine.config import rank_port_offset

    with pytest.raises(ConfigError):
        rank_port_offset(**{"tp_size": None, "dp_index": 0, **kwargs})


def test_advertise_host_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv("HT_TEST_HOST_IP", " 10.1.2.3\n")
    config = EngineConfig.from_dict({"side_channel_host": "0.0.0.0", "advertise_host": "env:HT_TEST_HOST_IP"})
    assert config.advertise_host == "10.1.2.3"


@pytest.mark.parametrize("value", ["env:HT_TEST_UNSET_VAR", "env:", "env:HT_TEST_EMPTY_VAR"])
def test_an_unset_or_empty_variable_is_refused_naming_it(monkeypatch, value):
    monkeypatch.delenv("HT_TEST_UNSET_VAR", raising=False)
    monkeypatch.setenv("HT_TEST_EMPTY_VAR", "  ")
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"advertise_host": value})
    assert info.value.field == "advertise_host" and info.value.value == value
    assert value in str(info.value)


def test_advertise_host_from_an_interface():
    assert EngineConfig.from_dict({"advertise_host": "interface:lo"}).advertise_host == "127.0.0.1"


@pytest.mark.parametrize("value", ["interface:no-such-if0", "interface:", "interface:" + "x" * 16])
def test_an_unknown_interface_is_refused_naming_it(value):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"advertise_host": value})
    assert info.value.field == "advertise_host" and value in str(info.value)


def test_an_unresolved_host_source_is_refused_outside_from_dict():
    with pytest.raises(ConfigError) as info:
        EngineConfig(advertise_host="env:HT_TEST_HOST_IP").validate()
    assert info.value.field == "advertise_host"


def test_the_bind_host_from_an_interface_or_a_variable(monkeypatch):
    """Bind only the transfer network's interface, from the same one dict on every host."""
    monkeypatch.setenv("HT_TEST_BIND_IP", "127.0.0.1")
    assert EngineConfig.from_dict({"side_channel_host": "interface:lo"}).side_channel_host == "127.0.0.1"
    assert EngineConfig.from_dict({"side_channel_host": "env:HT_TEST_BIND_IP"}).side_channel_host == "127.0.0.1"
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"side_channel_host": "interface:no-such-if0"})
    assert info.value.field == "side_channel_host"
    with pytest.raises(ConfigError) as info:
        EngineConfig(side_channel_host="interface:lo").validate()
    assert info.value.field == "side_channel_host"


def test_an_echoed_source_is_cut():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"advertise_host": "env:" + "V" * 100_000})
    assert len(str(info.value)) < 2_000 and info.value.value == "env:" + "V" * 100_000
