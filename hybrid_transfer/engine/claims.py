"""Single-use tickets (issue 14): the digest a claim carries, and a producer's bounded memory of ended tickets.

READs are one-sided: a producer cannot refuse one. So liveness is proven before DONE instead. When a
consumer rank posts its READs it sends each source rank a Claim with a digest of the ticket fields
it read by; the rank answers CONFIRMED only when it holds that request with that nonce, the digest
matches its own record (an edited ticket does not), and this consumer rank has not claimed it
before. The consumer reports DONE only after every source confirmed; any other answer ends the
request FAILED with a typed cause, with or without a secret: the producer's own record is the
authority, so no key is needed to catch an edit.

The ticket itself carries ``mac``: HMAC-SHA256 over that digest under a key derived from the
shared secret, the engine id and the incarnation; without a secret it is the bare digest (a
checksum: an edit must then be caught by the claim). Whoever issues a ticket signs it (``sign``):
``Producer.hold`` and ``tickets.issue_ticket``. A consumer checks it before any READ
(``mac_ok``) and fails an edited ticket at once, nothing read; ``Producer.hold(ticket=...)``
refuses one. An empty ``mac`` (an unsigned ticket) is accepted only where no secret is set.

Memory: claims live on their hold (one set of ranks) and go with it; ended tickets are remembered
for one lease in at most ``capacity`` entries, so a replay of a freed ticket is answered ENDED.
A replay older than that finds no record and is kept like an early completion (lifecycle/early.py): it is
never confirmed, so the consumer's read deadline ends it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

_ENCODER = msgspec.msgpack.Encoder()
# The ticket fields the digest covers, in the order they are encoded (engine/inputs.py encodes these once, for
# its own check and for the digest).
DIGEST_FIELDS = ("engine_id", "incarnation", "request_id", "nonce", "block_ids", "num_tokens", "state_position")
_DIGEST_PREFIX = b"hybrid-transfer ticket\0"
_SEQUENCES = frozenset({tuple, list})  # msgpack writes both as the same array


def ticket_digest(engine_id: str, incarnation: int, request_id: str, nonce: int,
                  block_ids: Sequence[Sequence[int]], num_tokens: int, state_position: int) -> bytes:
    """SHA-256 of the fields that decide which bytes a ticket reads."""
    if type(block_ids) not in _SEQUENCES or not _SEQUENCES.issuperset(map(type, block_ids)):
        block_ids = [list(g) for g in block_ids]  # any other iterable group is encoded as the list of its ids
    return digest_of_encoded(_ENCODER.encode((engine_id, incarnation, request_id, nonce, block_ids, num_tokens,
                                              state_position)))


def digest_of_encoded(fields: bytes) -> bytes:
    """The digest from the msgpack array of the DIGEST_FIELDS values, in that order (what ticket_digest encodes).

    A copy of the hash state after the prefix costs less than a new hash object (a third of the digest's time)."""
    state = _PREFIX_STATE.copy()
    state.update(fields)
    return state.digest()


_PREFIX_STATE = hashlib.sha256(_DIGEST_PREFIX)


# (ticket, its digest or b"" not yet hashed, the encoded DIGEST_FIELDS or b""): a consumer needs the digest twice
# per request, and inputs.ticket has encoded those fields already.
_last_digest: tuple[object, bytes, bytes] = (None, b"", b"")


def digest_of(ticket) -> bytes:
    """The digest of a wire.Ticket, as the consumer read by it.

    The last ticket's digest is kept: the consumer checks the MAC and then claims with the same ticket object.
    A Ticket is a frozen struct, and the entry holds it, so the same object always has the same fields.
    """
    global _last_digest
    last = _last_digest
    if last[0] is ticket:
        if last[1]:
            return last[1]
        digest = digest_of_encoded(last[2])
    else:
        digest = ticket_digest(ticket.engine_id, ticket.incarnation, ticket.request_id, ticket.nonce,
                               ticket.block_ids, ticket.num_tokens, ticket.state_position)
    _last_digest = (ticket, digest, b"")
    return digest


def remember_encoded(ticket, fields: bytes) -> None:
    """Let digest_of hash ``fields`` for this ticket object rather than encode its fields again.

    ``fields``: what ticket_digest encodes for the ticket, the msgpack array of its DIGEST_FIELDS values
    (inputs.ticket decoded the ticket from these very bytes; tests/engine/test_admission.py checks it)."""
    global _last_digest
    _last_digest = (ticket, b"", fields)


_KEYS: OrderedDict[tuple[bytes, str, int], bytes] = OrderedDict()  # (secret, engine id, incarnation) -> key
_MAX_KEYS = 256  # producer engine incarnations whose key is kept (a consumer links to a handful)


def ticket_key(secret: bytes | None, engine_id: str, incarnation: int) -> bytes:
    """The key of one producer engine incarnation's ticket MACs (b"" without a secret).

    Kept for the last ``_MAX_KEYS`` incarnations: a consumer checks every ticket with its engine's key, and
    deriving it is a second HMAC per request."""
    if secret is None:
        return b""
    entry = (secret, engine_id, incarnation)
    key = _KEYS.get(entry)
    if key is None:
        key = hmac.digest(secret, b"hybrid-transfer ticket key\0" + _ENCODER.encode((engine_id, incarnation)), "sha256")
        _KEYS[entry] = key
        if len(_KEYS) > _MAX_KEYS:
            _KEYS.popitem(last=False)
    return key


def ticket_mac(ticket, secret: bytes | None, digest: bytes | None = None) -> bytes:
    """What ``ticket.mac`` must be under ``secret`` (the bare digest without one); ``digest``: digest_of(ticket)."""
    digest = digest_of(ticket) if digest is None else digest
    if secret is None:
        return digest
    return hmac.digest(ticket_key(secret, ticket.engine_id, ticket.incarnation), digest, "sha256")


def sign(ticket, secret: bytes | None):
    """``ticket`` with its ``mac`` set."""
    return msgspec.structs.replace(ticket, mac=ticket_mac(ticket, secret))


def mac_ok(ticket, secret: bytes | None, digest: bytes | None = None) -> bool:
    """The ticket's MAC matches its fields (an unsigned ticket passes only without a secret)."""
    if not ticket.mac:
        return secret is None
    return hmac.compare_digest(ticket.mac, ticket_mac(ticket, secret, digest))


class EndedTickets:
    """(request id, nonce) of holds that ended, for ``lease_s`` each, at most ``capacity`` (oldest go first)."""

    def __init__(self, clock: Callable[[], float], lease_s: float, capacity: int = 1 << 16):
        self._clock = clock
        self._lease_s = float(lease_s)
        self._capacity = capacity
        self._until: OrderedDict[tuple[str, int], float] = OrderedDict()

    def add(self, request_id: str, nonce: int) -> None:
        self._until.pop((request_id, nonce), None)
        self._until[(request_id, nonce)] = self._clock() + self._lease_s
        while len(self._until) > self._capacity:
            self._until.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        self._prune()
        return key in self._until

    def __len__(self) -> int:
        self._prune()
        return len(self._until)

    def _prune(self) -> None:
        now = self._clock()
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                break
            del self._until[key]
