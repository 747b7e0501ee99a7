"""Side-channel addresses: their syntax, and which producers a consumer may connect to.

A ticket names the side-channel address of every producer rank, and it reaches a decode worker
inside a client's request (vLLM's ``kv_transfer_params``). Without a shared secret its MAC is a
plain digest anyone can compute, so the ticket cannot be what decides where a consumer connects:
a consumer connects only to addresses that ``EngineConfig.allowed_producers`` lists (loopback
only by default; docs/security.md#allowed-producers). Host names are compared as written, never
resolved: resolving would block the owner thread, and a name that resolves differently later
would slip past the list.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from hybrid_transfer.errors import ConfigError

DEFAULT_ALLOWED_PRODUCERS = ("127.0.0.0/8", "::1", "localhost")
_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_PORTS = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")
MAX_HOST_CHARS = 253  # a DNS name
_LONGEST_ADDRESS = MAX_HOST_CHARS + 16  # "tcp://", brackets, ":" and a port around a host: a longer str never parses
MAX_VERDICTS = 1024  # addresses whose allowed_producers verdict one AllowedProducers keeps
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Endpoint:
    """One ``tcp://host:port`` address: ``ip`` is set for a literal address, ``host`` is lower-case."""

    host: str
    port: int
    ip: IpAddress | None


def shown(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; never raises (an int of 100,000 digits has no repr)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 600:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > limit:
        text = repr(value[:limit]) if not isinstance(value, dict) else f"<a dict of {len(value)} keys>"
        return f"{text[:limit]}... ({len(value)} long)"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile object's __repr__; we only describe it
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def _host(text: str) -> tuple[str, IpAddress | None]:
    """A host name or literal address (IPv6 in brackets) -> (lower-case host, its ip or None).

    Raises:
        ConfigError: neither a literal address nor a DNS name.
    """
    if text.startswith("["):
        if not text.endswith("]"):
            raise ConfigError(f"host {shown(text)} opens a bracket it does not close", field="address", value=text)
        try:
            ip = ipaddress.IPv6Address(text[1:-1])
        except ValueError:
            raise ConfigError(f"host {shown(text)} is not an IPv6 address in brackets", field="address",
                              value=text) from None
        return str(ip), ip
    try:
        ip = ipaddress.IPv4Address(text)
        return str(ip), ip
    except ValueError:
        pass
    labels = text.split(".")
    if not 0 < len(text) <= MAX_HOST_CHARS or not all(_LABEL.fullmatch(label) for label in labels) or (
            labels[-1].isdigit()):  # "10.1.2" or "999.1.1.1": a botched address, not a name
        raise ConfigError(f"host {shown(text)} is not an IPv4 address, an [IPv6] address or a DNS name",
                          field="address", value=text)
    return text.lower(), None


def parse_address(address: object) -> Endpoint:
    """A side-channel address as tickets and replies carry it: ``tcp://host:port``, port in [1, 65535].

    Raises:
        ConfigError: anything else (``field`` is "address", the message shows the value cut short).
    """
    if not isinstance(address, str):
        raise ConfigError(f"address {shown(address)} must be a string", field="address", value=shown(address))
    return _parse(address)


@functools.lru_cache(maxsize=1024)  # the same few producer addresses come in every ticket; errors are not cached
def _parse(address: str) -> Endpoint:
    match = _ADDRESS.fullmatch(address) if len(address) <= _LONGEST_ADDRESS else None
    if match is None:
        raise ConfigError(f"address {shown(address)} is not tcp://HOST:PORT (HOST a name, an IPv4 address or an "
                          "[IPv6] address)", field="address", value=shown(address))
    host, ip = _host(match.group(1))
    port = int(match.group(2))
    if not 0 < port <= 65535:
        raise ConfigError(f"address {shown(address)}: port {port} is outside [1, 65535]", field="address",
                          value=address)
    return Endpoint(host, port, ip)


@dataclass(frozen=True)
class _Rule:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    name: str | None
    ports: tuple[int, int]

    def allows(self, endpoint: Endpoint) -> bool:
        if not self.ports[0] <= endpoint.port <= self.ports[1]:
            return False
        if self.network is not None:
            return endpoint.ip is not None and endpoint.ip.version == self.network.version and (
                endpoint.ip in self.network)
        return endpoint.ip is None and endpoint.host == self.name


def _rule(entry: object) -> _Rule:
    """One entry: HOST, CIDR, [IPv6] or [IPv6 CIDR], each optionally followed by :PORT or :FIRST-LAST.

    Raises:
        ConfigError: an entry of another form (``field`` is "allowed_producers").
    """
    if not isinstance(entry, str) or not entry:
        raise ConfigError(f"EngineConfig.allowed_producers entry {shown(entry)} must be a non-empty string",
                          field="allowed_producers", value=entry)
    if entry.startswith("["):
        head, closed, rest = entry[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            head = entry  # reported below: not a bracketed address
        ports_text = rest[1:] if rest else ""
    elif entry.count(":") > 1:  # a bare IPv6 address or network: no port
        head, ports_text = entry, ""
    else:
        head, _, ports_text = entry.partition(":")
    try:
        ports = _ports(ports_text, entry) if ports_text or entry.endswith(":") else (1, 65535)
        try:
            network = ipaddress.ip_network(head, strict=False)
        except ValueError:
            host, ip = _host(head)
            if ip is not None:  # pragma: no cover - ip_network takes every literal _host takes
                network = ipaddress.ip_network(ip)
            else:
                return _Rule(None, host, ports)
        return _Rule(network, None, ports)
    except ConfigError as exc:
        raise ConfigError(f"EngineConfig.allowed_producers entry {shown(entry)}: {exc}; expected HOST, CIDR or "
                          "[IPv6], optionally :PORT or :FIRST-LAST (e.g. 10.1.2.0/24:5600-5700)",
                          field="allowed_producers", value=entry) from None


def _ports(text: str, entry: str) -> tuple[int, int]:
    match = _PORTS.fullmatch(text)
    if match is None:
        raise ConfigError(f"ports {shown(text)} are not PORT or FIRST-LAST", field="allowed_producers", value=entry)
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else first
    if not 0 < first <= last <= 65535:
        raise ConfigError(f"ports {first}-{last} are not a range inside [1, 65535]", field="allowed_producers",
                          value=entry)
    return first, last


class AllowedProducers:
    """The producers a consumer may connect to, from ``EngineConfig.allowed_producers``.

    Raises (constructor):
        ConfigError: no entry, or an entry that is not HOST / CIDR / [IPv6] with optional ports.
    """

    def __init__(self, entries: Iterable[str]):
        if isinstance(entries, str):
            raise ConfigError(f"EngineConfig.allowed_producers={shown(entries)} must be a list of entries, not one "
                              "string", field="allowed_producers", value=entries)
        self.entries = tuple(entries)
        if not self.entries:
            raise ConfigError("EngineConfig.allowed_producers is empty: this consumer could connect to no producer",
                              field="allowed_producers", value=self.entries)
        self._rules = tuple(_rule(e) for e in self.entries)
        self._verdicts: dict[str, bool] = {}  # address -> allowed, at most MAX_VERDICTS (oldest go first)

    def allows(self, address: str) -> bool:
        """Whether ``address`` (any value) is a well-formed address this list allows.

        Every ticket names the same few producer addresses, so each verdict, allowed or refused, is kept by the
        exact string (the rules never change); a str longer than any address is judged anew (it never parses).
        """
        if type(address) is str:
            verdict = self._verdicts.get(address)
            if verdict is not None:
                return verdict
            verdict = self._judge(address)
            if len(address) <= _LONGEST_ADDRESS:
                self._remember(address, verdict)
            return verdict
        return self._judge(address)

    def _judge(self, address: object) -> bool:
        """The rules' verdict, without the cache."""
        try:
            endpoint = parse_address(address)
        except ConfigError:
            return False
        return any(rule.allows(endpoint) for rule in self._rules)

    def _remember(self, address: str, verdict: bool) -> None:
        """Keep a verdict, evicting the oldest past MAX_VERDICTS: hostile tickets may name endless addresses."""
        verdicts = self._verdicts
        while len(verdicts) >= MAX_VERDICTS:
            verdicts.pop(next(iter(verdicts)), None)
        verdicts[address] = verdict

    def __repr__(self) -> str:
        return f"AllowedProducers({list(self.entries)!r})"
