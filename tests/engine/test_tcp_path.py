"""engine/tcp_path.py: the interface UCX's TCP path uses, and a loud failure where there is none.

These read the interface list (an ioctl on an unbound UDP socket) and send nothing, so they run on the
host; the transfers over the interface run in a network namespace of their own (tests/netns.py).
"""

from __future__ import annotations

import socket

import pytest

from hybrid_transfer.engine import tcp_path
from hybrid_transfer.errors import ConfigError


def test_the_first_network_interface_is_not_loopback_and_owns_its_address():
    iface = tcp_path.first_network_interface()
    assert not iface.ipv4.startswith("127.")
    assert iface in tcp_path.interfaces_ipv4()
    assert socket.inet_aton(iface.ipv4)


def test_a_host_with_only_loopback_fails_naming_what_it_saw(monkeypatch):
    monkeypatch.setattr(tcp_path.socket, "if_nameindex", lambda: [(1, "lo")])
    with pytest.raises(ConfigError, match=r"seen: lo=127\.0\.0\.1") as err:
        tcp_path.first_network_interface()
    assert err.value.field == "interface"


def test_tcp_only_env_names_the_interface_and_refuses_an_unknown_one():
    iface = tcp_path.first_network_interface()
    assert tcp_path.tcp_only_env(iface.name) == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": iface.name}
    with pytest.raises(ConfigError, match="'no-such0'"):
        tcp_path.tcp_only_env("no-such0")
