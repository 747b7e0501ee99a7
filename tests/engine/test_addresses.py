"""engine/addresses.py: the syntax of side-channel addresses and the allowed_producers list (no sockets here)."""

from __future__ import annotations

import pytest

from hybrid_transfer.engine.addresses import DEFAULT_ALLOWED_PRODUCERS, AllowedProducers, parse_address, shown
from hybrid_transfer.errors import ConfigError


@pytest.mark.parametrize(("address", "host", "port"), [
    ("tcp://127.0.0.1:5600", "127.0.0.1", 5600),
    ("tcp://[::1]:1", "::1", 1),
    ("tcp://[FD00::0001]:65535", "fd00::1", 65535),
    ("tcp://Prefill-0.Example.com:5600", "prefill-0.example.com", 5600),
])
def test_well_formed_addresses_parse(address, host, port):
    endpoint = parse_address(address)
    assert (endpoint.host, endpoint.port) == (host, port)


@pytest.mark.parametrize("address", [
    "garbage", "", "tcp://", "tcp://host", "tcp://host:0", "tcp://host:65536", "tcp://host:5600/path",
    "udp://host:5600", "tcp://[::1:5600", "tcp://::1:5600", "tcp://[::g]:5600", "tcp://-host:5600",
    "tcp://10.1.2:5600", "tcp://999.1.1.1:5600", "tcp://host :5600", "tcp://" + "a" * 300 + ":1", 5, None, b"tcp://h:1",
])
def test_malformed_addresses_are_a_config_error_with_the_value_cut_short(address):
    with pytest.raises(ConfigError) as info:
        parse_address(address)
    assert info.value.field == "address" and len(str(info.value)) < 400


def test_the_default_allows_loopback_only():
    allowed = AllowedProducers(DEFAULT_ALLOWED_PRODUCERS)
    for address in ("tcp://127.0.0.1:5600", "tcp://127.9.9.9:1", "tcp://[::1]:5600", "tcp://localhost:5600",
                    "tcp://LOCALHOST:5600"):
        assert allowed.allows(address), address
    for address in ("tcp://10.0.0.1:5600", "tcp://[::2]:5600", "tcp://localhost.evil:5600", "tcp://0.0.0.0:5600",
                    "garbage", ["tcp://127.0.0.1:1"], None):
        assert not allowed.allows(address), address


def test_entries_with_ports_networks_and_names():
    allowed = AllowedProducers(["10.1.2.0/24:5600-5700", "prefill-0.example:5600", "[fd00::/8]:7000", "::1",
                                "192.168.0.7"])
    cases = {
        "tcp://10.1.2.200:5600": True, "tcp://10.1.2.200:5700": True, "tcp://10.1.2.200:5701": False,
        "tcp://10.1.3.1:5600": False, "tcp://prefill-0.example:5600": True, "tcp://prefill-0.example:5601": False,
        "tcp://prefill-1.example:5600": False, "tcp://[fd00::9]:7000": True, "tcp://[fd00::9]:7001": False,
        "tcp://[::1]:1234": True, "tcp://192.168.0.7:1": True, "tcp://192.168.0.8:1": False,
    }
    assert {a: allowed.allows(a) for a in cases} == cases
    # A name is never resolved: 127.0.0.1 allowed says nothing about a name that may resolve to it.
    assert not AllowedProducers(["127.0.0.0/8"]).allows("tcp://localhost:5600")


@pytest.mark.parametrize("entries", [(), "127.0.0.1", ("",), ("10.0.0.0/33",), ("host:",), ("host:0",),
                                     ("host:9-3",), ("host:70000",), ("[::1",), ("[::1]x",), ("a b",), (5,)])
def test_bad_entries_are_refused_naming_the_setting(entries):
    with pytest.raises(ConfigError) as info:
        AllowedProducers(entries)
    assert info.value.field == "allowed_producers"


def test_shown_never_raises_and_cuts_at_200_characters():
    assert shown(2**100000) == "<an integer of 100001 bits>"
    assert len(shown("x" * 10**6)) < 260 and "(1000000 long)" in shown("x" * 10**6)
    assert len(shown(list(range(10**5)))) < 260 and shown(5) == "5"

    class Hostile:
        def __repr__(self):
            raise RuntimeError("no")

    assert shown(Hostile()) == "<a Hostile>"
