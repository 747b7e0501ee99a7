"""UCX's network path on one host: the interface to use, and the environment that limits UCX to TCP on it.

Between two hosts UCX moves bytes over the network (rc/ud/dc on RDMA NICs, tcp otherwise); on one host
it prefers shared memory (cma, posix, cuda_ipc), so a transfer between two local processes never touches
the network unless UCX is told to: ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=<interface>``. UCX reads these
when a process creates its first UCX context (the NIXL agent's UCX backend), so they must be in that
process's environment before the agent exists (docs/between-hosts.md).

The address a producer advertises must be one a peer can reach: the interface's own IPv4 address, not
``gethostbyname(gethostname())``, which is 127.0.0.1 on hosts whose /etc/hosts maps the name to loopback.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from hybrid_transfer.engine.config import resolve_host_source
from hybrid_transfer.errors import ConfigError

LOOPBACK_PREFIX = "127."


@dataclass(frozen=True)
class Interface:
    """A network interface and its IPv4 address."""

    name: str
    ipv4: str


def interfaces_ipv4() -> list[Interface]:
    """Every interface of this host that has an IPv4 address, in the kernel's index order."""
    found = []
    for _, name in socket.if_nameindex():
        try:
            ipv4 = resolve_host_source(f"interface:{name}", field="advertise_host")
        except ConfigError:  # no IPv4 address (down, IPv6 only, or an ifb/tunnel device)
            continue
        found.append(Interface(name, ipv4))
    return found


def first_network_interface() -> Interface:
    """The first interface whose IPv4 address is not loopback: where TCP between hosts would go.

    Raises:
        ConfigError: this host has no such interface (it lists the interfaces it saw).
    """
    seen = interfaces_ipv4()
    for iface in seen:
        if not iface.ipv4.startswith(LOOPBACK_PREFIX):
            return iface
    listed = ", ".join(f"{i.name}={i.ipv4}" for i in seen) or "none with an IPv4 address"
    raise ConfigError(f"no network interface with a non-loopback IPv4 address on this host (seen: {listed}); "
                      "UCX's TCP path needs one", field="interface", value=listed)


def tcp_only_env(interface: str) -> dict[str, str]:
    """The UCX variables that limit a process's transfers to TCP over ``interface`` (set before its agent exists).

    Raises:
        ConfigError: ``interface`` is not an interface of this host with an IPv4 address.
    """
    names = {i.name for i in interfaces_ipv4()}
    if interface not in names:
        raise ConfigError(f"interface {interface!r} has no IPv4 address on this host (have: {sorted(names)})",
                          field="interface", value=interface)
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": interface}


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Within the block, ``os.environ`` carries ``env``; each variable's earlier value (or its absence) is restored after.

    UCX reads its variables when a process creates its first UCX context, and a spawned process takes its
    parent's environment when it starts, so setting them only around that moment is enough.
    """
    env = dict(env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
