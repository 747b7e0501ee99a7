"""Authentication with a shared secret (issue 14): the handshake's challenge-response, link keys, sealed notifications.

The secret comes from the environment (``HYBRID_TRANSFER_SECRET``) or a file named by
``EngineConfig.secret_file``; never from a config value, never logged (docs/security.md).

Handshake, both sides proving the secret without sending it:
  1. consumer -> producer: HandshakeRequest with a fresh client nonce ``cn``;
  2. producer -> consumer: AuthChallenge with a fresh server nonce ``sn`` and its proof
     HMAC(secret, "producer" | cn | sn | producer agent | consumer agent);
  3. consumer -> producer: the same HandshakeRequest with ``sn`` and its own proof ("consumer" | ...);
  4. producer -> consumer: the accepted reply (agent metadata), only now.
Both then hold the link key HMAC(secret, "link" | cn | sn | producer agent | consumer agent): bound
to both NIXL agent names and fresh per handshake. The producer keeps nothing between steps 2 and 3:
its server nonce is a MAC under a per-process key (``Challenges``), so a flood of first requests
cannot evict an honest consumer's challenge; an accepted exchange is remembered (bounded, until its
nonce's deadline) only to refuse its replay.

Every NIXL notification between the two agents is then a Sealed envelope: the inner message, a
counter that strictly increases per link and direction (NIXL notifications are ordered per
connection), and HMAC(link key, direction | counter | inner). A forged, edited, reflected or
replayed notification fails ``Link.open``.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import logging
import os
import secrets
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_transfer.engine.log_gate import LogGate
from hybrid_transfer.errors import ConfigError

log = logging.getLogger(__name__)

SECRET_ENV = "HYBRID_TRANSFER_SECRET"
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
TO_PRODUCER = b"c>p"  # direction labels: a message can never be reflected back to its sender
TO_CONSUMER = b"p>c"


class Secret(bytes):
    """Key bytes that never print: ``repr()`` and ``str()`` give only the length, so no repr of an object
    (or of a dict or record) holding a secret, a link key or a process key shows it (docs/security.md).
    Everything else behaves as ``bytes``; an explicit ``.hex()`` still shows the value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<secret: {len(self)} bytes>"

    __str__ = __repr__


def load_secret(secret_file: str | None) -> bytes | None:
    """The engine secret: ``secret_file``'s content, else the environment variable, else None.

    Surrounding whitespace is stripped. The value is never logged or put in an error message.

    Raises:
        ConfigError: the file cannot be read, or the secret is shorter than 16 bytes or empty.
    """
    if secret_file is not None:
        try:
            raw = Path(secret_file).read_bytes()[: MAX_SECRET_BYTES + 1]
        except OSError as exc:
            raise ConfigError(f"EngineConfig.secret_file={secret_file!r} cannot be read: {exc.strerror}",
                              field="secret_file", value=secret_file) from exc
        where = f"secret_file {secret_file!r}"
    else:
        value = os.environ.get(SECRET_ENV)
        if value is None:
            return None
        raw, where = value.encode(), f"${SECRET_ENV}"
    secret = raw.strip()
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ConfigError(f"the secret in {where} must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, "
                          f"it has {len(secret)}", field="secret_file", value=secret_file)
    return Secret(secret)


_warned_open = False


def warn_if_open(secret: bytes | None, who: str) -> None:
    """One warning per process when an engine runs without a secret."""
    global _warned_open
    if secret is None and not _warned_open:
        _warned_open = True
        log.warning("%s: no shared secret: handshakes are not authenticated, and anyone who reaches the "
                    "side-channel port can read and write registered memory. To fix, give every engine the same "
                    "secret before it starts: export %s=$(openssl rand -hex 32) (or EngineConfig.secret_file); "
                    "only on an isolated network may it run without (docs/security.md). Said once per process.",
                    who, SECRET_ENV)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes | str) -> bytes:
    """HMAC-SHA256 of ``label`` then each part, length-prefixed so that no two part lists hash alike; the
    message is joined first and hashed in one C call (every notification both ways is sealed and checked)."""
    pieces = [label]
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        pieces.append(len(data).to_bytes(4, "big"))
        pieces.append(data)
    return hmac.digest(key, b"".join(pieces), "sha256")


def proof(secret: bytes, role: str, cn: bytes, sn: bytes, producer_agent: str, consumer_agent: str) -> bytes:
    """What ``role`` ("producer" or "consumer") sends to show it knows the secret, for this exchange only."""
    return _mac(secret, role.encode(), cn, sn, producer_agent, consumer_agent)


def link_key(secret: bytes, cn: bytes, sn: bytes, producer_agent: str, consumer_agent: str) -> bytes:
    return Secret(_mac(secret, b"link", cn, sn, producer_agent, consumer_agent))


def curve_seed(secret: bytes) -> bytes:
    """32 bytes for the side channel's CURVE server key pair (side_channel.Curve), derived from the secret."""
    return Secret(_mac(secret, b"curve server key"))


def side_channel_curve(enabled: bool, secret: bytes | None):
    """The side channel's CURVE settings (side_channel.Curve) when ``enabled``, else None.

    Raises:
        ConfigError: CURVE asked for without a secret, or this ZeroMQ has no CURVE support.
    """
    if not enabled:
        return None
    from hybrid_transfer.engine.side_channel import Curve

    if secret is None:
        raise ConfigError(f"EngineConfig.side_channel_curve=True needs the shared secret (${SECRET_ENV} or "
                          "EngineConfig.secret_file): the server key is derived from it", field="side_channel_curve",
                          value=True)
    if not Curve.available():
        raise ConfigError("EngineConfig.side_channel_curve=True, but this ZeroMQ was built without CURVE",
                          field="side_channel_curve", value=True)
    curve = Curve.from_seed(curve_seed(secret))
    return dataclasses.replace(curve, server_secret=Secret(curve.server_secret))  # z85 text of a key: never printed


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


class Verdict(enum.Enum):
    """What ``Challenges.take`` made of a proven request's server nonce (docs/security.md#authentication)."""

    FRESH = "fresh"  # issued by this rank within the deadline, never accepted before: go on
    STALE = "stale"  # issued by this rank, but longer ago than the deadline (or in its future)
    FORGED = "forged"  # not a nonce this rank issued to this (agent, client nonce)
    REPLAYED = "replayed"  # already accepted once
    FULL = "full"  # the record of accepted exchanges is full of live entries: refused, try later


class Challenges:
    """Server nonces that need no state before the proof: a flood of first requests cannot push one out.

    A server nonce is the producer's clock at issue (8 bytes, milliseconds) followed by the first 24 bytes of
    HMAC(process key, consumer agent, client nonce, issue time): the process key is drawn at start and never
    leaves this object, so only this rank can mint a nonce, and checking one needs nothing but the key.
    A nonce is valid ``deadline_s`` after its issue, and accepted at most once: a record of accepted
    exchanges, each kept until its nonce's deadline, at most ``capacity`` of them. When the record is full
    of live entries, a new proof is refused (``Verdict.FULL``, counted) rather than an entry forgotten,
    since a forgotten entry could be replayed. Only a peer that proved the secret adds to the record.
    Thread-safe; the listener thread is the only caller in an engine.
    """

    def __init__(self, clock: Callable[[], float], deadline_s: float, capacity: int):
        self._clock = clock
        self._deadline_ms = int(deadline_s * 1000)
        self._capacity = capacity
        self._key = Secret(secrets.token_bytes(32))  # the process key
        self._lock = threading.Lock()
        self._accepted: OrderedDict[bytes, int] = OrderedDict()  # server nonce -> its expiry (ms), oldest first
        self.num_full = 0  # proofs refused because the record was full

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _mint(self, consumer_agent: str, cn: bytes, issued_ms: int) -> bytes:
        stamp = issued_ms.to_bytes(8, "big", signed=True)
        return stamp + _mac(self._key, b"server nonce", consumer_agent, cn, stamp)[: NONCE_BYTES - 8]

    def issue(self, consumer_agent: str, cn: bytes) -> bytes:
        """A server nonce for (agent, cn); nothing is stored."""
        return self._mint(consumer_agent, cn, self._now_ms())

    def check(self, consumer_agent: str, cn: bytes, sn: bytes) -> Verdict:
        """Whether ``sn`` is a nonce this rank issued to (agent, cn), still valid and never accepted; records nothing."""
        if len(sn) != NONCE_BYTES:
            return Verdict.FORGED
        issued_ms = int.from_bytes(sn[:8], "big", signed=True)
        if not same(sn, self._mint(consumer_agent, cn, issued_ms)):
            return Verdict.FORGED
        age = self._now_ms() - issued_ms
        if not 0 <= age < self._deadline_ms:
            return Verdict.STALE
        with self._lock:
            return Verdict.REPLAYED if sn in self._accepted else Verdict.FRESH

    def take(self, consumer_agent: str, cn: bytes, sn: bytes) -> Verdict:
        """``check``, and when FRESH record the exchange as accepted (so it is FRESH once only)."""
        verdict = self.check(consumer_agent, cn, sn)
        if verdict is not Verdict.FRESH:
            return verdict
        now = self._now_ms()
        with self._lock:
            if sn in self._accepted:  # another thread took it meanwhile
                return Verdict.REPLAYED
            while self._accepted:  # entries expire in the order they were issued, near enough: prune the front
                first_sn, expiry = next(iter(self._accepted.items()))
                if expiry > now:
                    break
                del self._accepted[first_sn]
            if len(self._accepted) >= self._capacity:
                self.num_full += 1
                return Verdict.FULL
            self._accepted[sn] = int.from_bytes(sn[:8], "big", signed=True) + self._deadline_ms
        return Verdict.FRESH

    def __len__(self) -> int:
        """Accepted exchanges remembered (to refuse their replay)."""
        with self._lock:
            return len(self._accepted)


class Rejected(Exception):
    """A sealed notification failed its check; ``cause`` names why (counted, never raised to the embedder)."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


@dataclass(eq=False)
class Link:
    """One authenticated link's key and counters, as one side sees it."""

    key: bytes = field(repr=False)  # never in a repr (docs/security.md)
    send_label: bytes  # TO_PRODUCER on a consumer, TO_CONSUMER on a producer
    recv_label: bytes
    sent: int = 0  # counter of the last message sealed
    received: int = 0  # highest counter accepted: anything at or below it is a replay

    @classmethod
    def for_consumer(cls, key: bytes) -> Link:
        return cls(key, TO_PRODUCER, TO_CONSUMER)

    @classmethod
    def for_producer(cls, key: bytes) -> Link:
        return cls(key, TO_CONSUMER, TO_PRODUCER)

    def seal(self, inner: bytes) -> tuple[int, bytes]:
        """The next counter and the MAC of ``inner`` under it."""
        self.sent += 1
        return self.sent, _mac(self.key, self.send_label, self.sent.to_bytes(8, "big"), inner)

    def check(self, counter: int, mac: bytes, inner: bytes) -> None:
        """Accept one message (advancing the counter) or raise Rejected('mac' / 'replay')."""
        if not same(mac, _mac(self.key, self.recv_label, counter.to_bytes(8, "big"), inner)):
            raise Rejected("mac")
        if counter <= self.received:
            raise Rejected("replay")
        self.received = counter


class RejectionLog:
    """Rejected messages, counted by cause; the warning goes through the owner's LogGate (log_gate.py),
    which logs one line per cause per interval and a count of the rest (never one line per message)."""

    def __init__(self, who: str, gate: LogGate):
        self.who = who
        self.counts: Counter[str] = Counter()
        self._gate = gate

    def add(self, cause: str, sender: str) -> None:
        self.counts[cause] += 1
        self._gate.warning(f"auth:{cause}", "%s: dropped a notification that failed authentication (%s) from %r",
                           self.who, cause, sender[:80])
