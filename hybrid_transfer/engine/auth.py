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
to both NIXL agent names and fresh per handshake. A server nonce is used once and forgotten after
a deadline, in a table of bounded size.

Every NIXL notification between the two agents is then a Sealed envelope: the inner message, a
counter that strictly increases per link and direction (NIXL notifications are ordered per
connection), and HMAC(link key, direction | counter | inner). A forged, edited, reflected or
replayed notification fails ``Link.open``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
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
    return secret


_warned_open = False


def warn_if_open(secret: bytes | None, who: str) -> None:
    """One warning per process when an engine runs without a secret."""
    global _warned_open
    if secret is None and not _warned_open:
        _warned_open = True
        log.warning("%s: no shared secret (set $%s or EngineConfig.secret_file): handshakes are not authenticated, "
                    "and anyone who reaches the side-channel port can read and write registered memory; run only "
                    "on an isolated network (docs/security.md)", who, SECRET_ENV)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes | str) -> bytes:
    h = hmac.new(key, label, hashlib.sha256)
    for part in parts:  # length-prefixed, so no two part lists hash alike
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(4, "big"))
        h.update(data)
    return h.digest()


def proof(secret: bytes, role: str, cn: bytes, sn: bytes, producer_agent: str, consumer_agent: str) -> bytes:
    """What ``role`` ("producer" or "consumer") sends to show it knows the secret, for this exchange only."""
    return _mac(secret, role.encode(), cn, sn, producer_agent, consumer_agent)


def link_key(secret: bytes, cn: bytes, sn: bytes, producer_agent: str, consumer_agent: str) -> bytes:
    return _mac(secret, b"link", cn, sn, producer_agent, consumer_agent)


def curve_seed(secret: bytes) -> bytes:
    """32 bytes for the side channel's CURVE server key pair (side_channel.Curve), derived from the secret."""
    return _mac(secret, b"curve server key")


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
    return Curve.from_seed(curve_seed(secret))


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


class Challenges:
    """Server nonces a producer rank issued and not yet seen answered; the listener thread only.

    Bounded: at most ``capacity`` (the oldest go first), each valid ``deadline_s`` on the
    producer's clock, and used at most once.
    """

    def __init__(self, clock: Callable[[], float], deadline_s: float, capacity: int):
        self._clock = clock
        self._deadline_s = deadline_s
        self._capacity = capacity
        self._lock = threading.Lock()
        self._issued: OrderedDict[tuple[str, bytes], tuple[bytes, float]] = OrderedDict()

    def issue(self, consumer_agent: str, cn: bytes) -> bytes:
        sn = new_nonce()
        with self._lock:
            self._issued.pop((consumer_agent, cn), None)
            self._issued[(consumer_agent, cn)] = (sn, self._clock())
            while len(self._issued) > self._capacity:
                self._issued.popitem(last=False)
        return sn

    def take(self, consumer_agent: str, cn: bytes, sn: bytes) -> bool:
        """True once for the server nonce issued to (agent, cn), if it is still valid."""
        with self._lock:
            entry = self._issued.pop((consumer_agent, cn), None)
        return entry is not None and same(entry[0], sn) and self._clock() - entry[1] < self._deadline_s

    def __len__(self) -> int:
        with self._lock:
            return len(self._issued)


class Rejected(Exception):
    """A sealed notification failed its check; ``cause`` names why (counted, never raised to the embedder)."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


@dataclass(eq=False)
class Link:
    """One authenticated link's key and counters, as one side sees it."""

    key: bytes
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
