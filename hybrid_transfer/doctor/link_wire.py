"""The messages of ``doctor --serve`` / ``doctor --peer`` and how they travel: length-prefixed msgpack on one TCP socket.

One exchange per peer (docs/between-hosts.md#doctor-peer):
  1. server -> peer: Hello (its NIXL agent name, a fresh nonce ``sn``, whether it holds a secret, the size);
  2. peer -> server: Join (its agent name, a fresh nonce ``cn``, its proof of the secret, or b"");
  3. server -> peer: Offer (agent metadata, buffer address, the server's own proof) or Refused (why);
  4. the peer READs the buffer (bandwidth, then latency), then peer -> server: Finished (what it measured).
Proofs are ``engine.auth.proof`` under the engine secret with the roles "doctor-serve" / "doctor-peer": each
side proves the secret without sending it, bound to both nonces and both agent names. Every frame is
bounded (MAX_FRAME_BYTES) and every receive has a deadline.
"""

from __future__ import annotations

import socket
import struct
import time

import msgspec

from hybrid_transfer.engine.auth import new_nonce, proof, same
from hybrid_transfer.errors import ConfigError, EngineError

LINK_VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # NIXL agent metadata is a few KiB; anything near this is not a doctor peer
SERVE_ROLE = "doctor-serve"
PEER_ROLE = "doctor-peer"
DEFAULT_LINK_PORT = 5599  # one below the engine's default side-channel port: open both in a firewall


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="hello"):
    version: int
    server_agent: str
    sn: bytes
    secret_required: bool
    num_bytes: int


class Join(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="join"):
    version: int
    peer_agent: str
    cn: bytes
    proof: bytes = b""  # empty: the peer holds no secret


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="offer"):
    metadata: bytes
    addr: int
    num_bytes: int
    proof: bytes = b""  # empty: the server holds no secret


class Refused(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="refused"):
    reason: str


class Finished(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="finished"):
    verified: bool
    gbps: float | None = None
    latency_us: float | None = None
    error: str | None = None


Message = Hello | Join | Offer | Refused | Finished
_DECODER = msgspec.msgpack.Decoder(Message)
_ENCODER = msgspec.msgpack.Encoder()


def send(sock: socket.socket, message: Message) -> None:
    payload = _ENCODER.encode(message)
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def recv(sock: socket.socket, deadline: float, what: str, agent: str) -> Message:
    """The next message, before the monotonic ``deadline``.

    Raises:
        EngineError: the deadline passed, the peer closed the connection, a frame above MAX_FRAME_BYTES,
            or bytes that are no doctor message (``what`` names the awaited message, ``agent`` this side's agent).
    """
    head = _recv_exact(sock, 4, deadline, what, agent)
    size = struct.unpack(">I", head)[0]
    if size > MAX_FRAME_BYTES:
        raise EngineError(f"{what}: a frame of {size} bytes (at most {MAX_FRAME_BYTES}): not a doctor peer",
                          operation="doctor link", agent=agent)
    try:
        return _DECODER.decode(_recv_exact(sock, size, deadline, what, agent))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EngineError(f"{what}: not a doctor message ({exc})", operation="doctor link", agent=agent) from None


def _recv_exact(sock: socket.socket, size: int, deadline: float, what: str, agent: str) -> bytes:
    chunks = []
    while size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineError(f"{what} did not arrive before the deadline", operation="doctor link", agent=agent)
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(size, 1 << 16))
        except TimeoutError:
            continue  # the loop reports the deadline
        if not chunk:
            raise EngineError(f"the other side closed the connection while this side waited for {what}",
                              operation="doctor link", agent=agent)
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def prove(secret: bytes | None, role: str, cn: bytes, sn: bytes, server_agent: str, peer_agent: str) -> bytes:
    """This side's proof of the secret for one exchange; b"" without a secret."""
    return b"" if secret is None else proof(secret, role, cn, sn, server_agent, peer_agent)


def proven(secret: bytes, role: str, shown: bytes, cn: bytes, sn: bytes, server_agent: str, peer_agent: str) -> bool:
    """Whether ``shown`` is ``role``'s proof of ``secret`` for this exchange."""
    return bool(shown) and same(shown, proof(secret, role, cn, sn, server_agent, peer_agent))


def parse_peer_address(text: str) -> tuple[str, int]:
    """'HOST:PORT', '[IPv6]:PORT' or 'tcp://HOST:PORT' -> (host, port).

    Raises:
        ConfigError: anything else (names the value).
    """
    from hybrid_transfer.engine.addresses import parse_address

    address = text if text.startswith("tcp://") else f"tcp://{text}"
    try:
        endpoint = parse_address(address)
    except ConfigError as exc:
        raise ConfigError(f"--peer {text!r} is not HOST:PORT ({exc})", field="peer", value=text) from None
    return endpoint.host, endpoint.port


__all__ = ["DEFAULT_LINK_PORT", "LINK_VERSION", "MAX_FRAME_BYTES", "PEER_ROLE", "SERVE_ROLE", "Finished", "Hello",
           "Join", "Message", "Offer", "Refused", "new_nonce", "parse_peer_address", "prove", "proven", "recv",
           "send"]
