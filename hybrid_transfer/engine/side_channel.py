"""ZeroMQ transport of the handshake: a producer ROUTER served by one thread, consumer DEALERs.

Only bytes cross this module; what they mean is handshake.py's business.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from hybrid_transfer.engine.wire import MAX_MESSAGE_BYTES
from hybrid_transfer.errors import HandshakeError

log = logging.getLogger(__name__)

_POLL_MS = 50  # how often the listener looks at its stop flag; close() waits at most this long
_MAX_FRAMES = 3  # identity, REQ's empty delimiter, the message: a message of more frames is not ours


def url_host(host: str) -> str:
    """A host as it appears in a tcp:// address: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _limit_frames(sock: zmq.Socket, limit: int = MAX_MESSAGE_BYTES) -> None:
    """ZeroMQ drops a peer whose frame header announces more than ``limit`` bytes, before buffering it.

    Without this a 1 GiB frame is received whole and only then refused by the decoder. The limit is per
    frame: libzmq still assembles every frame of a multipart message before delivering it, and has no
    cap on their number; ours are one frame (DEALER) or two (REQ). The listener caps a message's total
    across its frames itself (``HandshakeServer``, docs/limits.md#side-channel).
    """
    sock.setsockopt(zmq.MAXMSGSIZE, limit)


@dataclass(frozen=True)
class Curve:
    """ZeroMQ CURVE encryption of the side channel (``EngineConfig.side_channel_curve``).

    The producer's key pair is derived from the shared secret (engine/auth.py ``curve_seed``), so
    every consumer that knows the secret knows the server's public key without another exchange;
    each consumer socket draws its own key pair. A peer without the key gets no answer at all.
    """

    server_public: bytes
    server_secret: bytes = field(repr=False)

    @classmethod
    def from_seed(cls, seed: bytes) -> Curve:
        """``seed``: 32 bytes derived from the secret."""
        secret = z85.encode(seed)
        return cls(zmq.curve_public(secret), secret)

    @staticmethod
    def available() -> bool:
        return bool(zmq.has("curve"))

    def serve(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret


class HandshakeServer:
    """A ROUTER socket answered by a named daemon thread.

    Guarantees: the thread only runs ZeroMQ and ``respond``, which never touches the NIXL agent: it
    reads immutable, precomputed handshake data, and for pack mode a copy-on-write staging directory
    that the owner thread replaces whole (pack/stager.py), so handshakes and staging queries are answered
    while the owner thread is busy. A frame that is not one message of ours is answered with
    whatever ``respond`` makes of it, or dropped; the thread never dies of peer bytes.
    A message whose frames exceed ``max_message_bytes`` in total, or that has more than
    ``_MAX_FRAMES`` frames, is read frame by frame without keeping any, dropped and counted in
    ``num_oversized``: it never reaches ``respond`` (nor is it ever joined into one buffer).
    ``close()`` is idempotent, stops the thread and waits for it.
    """

    def __init__(self, host: str, port: int, respond: Callable[[bytes], bytes | None], *, name: str,
                 advertise_host: str | None = None, curve: Curve | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self._respond = respond
        self._max_bytes = max_message_bytes
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.serve(self._sock)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting consumer keeps its identity
        _limit_frames(self._sock, max_message_bytes)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        if port:
            self._sock.bind(f"tcp://{url_host(host)}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{url_host(host)}")
        # What peers connect to: never the bind host when that is a wildcard (config.py checks).
        self.address = f"tcp://{url_host(advertise_host or host)}:{port}"
        self.num_served = 0
        self.num_dropped = 0
        self.num_oversized = 0  # messages over max_message_bytes in total (or _MAX_FRAMES frames): dropped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        """Start answering (bind happens in the constructor, so ``address`` is known before)."""
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_POLL_MS):
                    continue
                frames = self._receive()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.warning("handshake listener %s: %s", self.address, exc)
                continue
            if frames is None:
                self.num_oversized += 1
                continue
            identity, payload = frames[0], frames[1:]
            # DEALER peers send one frame; REQ peers prepend an empty delimiter we must echo.
            prefix = [b""] if payload and payload[0] == b"" else []
            payload = payload[len(prefix):]
            try:
                reply = self._respond(payload[0] if len(payload) == 1 else b"".join(payload))
            except Exception:  # noqa: BLE001 - respond is ours, but this thread must outlive its bugs
                log.exception("handshake listener %s: responder failed", self.address)
                reply = None
            if reply is None:
                self.num_dropped += 1
                continue
            try:
                self._sock.send_multipart([identity, *prefix, reply], zmq.NOBLOCK)
                self.num_served += 1
            except zmq.ZMQError as exc:
                self.num_dropped += 1
                log.debug("handshake listener %s: reply not sent: %s", self.address, exc)
        self._sock.close(0)

    def _receive(self) -> list[bytes] | None:
        """One message's frames (identity first), or None when they exceed the caps.

        libzmq hands over a multipart message only once all its frames arrived, so every frame is here:
        each is taken without a copy and let go at once when the message is over the cap.
        """
        frames: list[bytes] = []
        total, over = 0, False
        while True:
            frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            if not over:
                total += len(frame.buffer)
                over = total > self._max_bytes or len(frames) == _MAX_FRAMES
                if over:
                    frames.clear()
                else:
                    frames.append(frame.bytes)
            if not frame.more:
                return None if over else frames

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._sock.close(0)
        self._ctx.term()


class HandshakeClient:
    """One DEALER per producer rank address, non-blocking; owned by the consumer's owner thread.

    At most ``max_sockets`` are open at once (``EngineConfig.max_handshake_sockets``): a socket lives
    only while its handshake is pending, and the caller drops it when the reply came or the deadline passed.
    """

    def __init__(self, curve: Curve | None = None, *, max_sockets: int = 64):
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._curve = curve
        self._max_sockets = max_sockets

    @property
    def num_sockets(self) -> int:
        return len(self._socks)

    def send(self, address: str, payload: bytes) -> None:
        """Queue ``payload`` for ``address`` (connecting on first use); never blocks.

        Raises:
            HandshakeError: ``max_sockets`` are open (cause "capacity"), or ZeroMQ refused the address
                or the send (cause "unreachable"); no socket is left open for it.
        """
        sock = self._socks.get(address)
        if sock is None:
            if len(self._socks) >= self._max_sockets:
                raise HandshakeError(f"{self._max_sockets} handshake sockets are open (max_handshake_sockets)",
                                     address=address, cause="capacity")
            sock = self._ctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 64)
                _limit_frames(sock)
                if self._curve is not None:
                    self._curve.connect(sock)
                if "[" in address:  # an IPv6 literal
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(address)
            except zmq.ZMQError as exc:
                sock.close(0)
                raise HandshakeError(f"cannot connect: {exc}", address=address, cause="unreachable") from exc
            self._socks[address] = sock
            self._poller.register(sock, zmq.POLLIN)
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.drop([address])
            raise HandshakeError(f"cannot send: {exc}", address=address, cause="unreachable") from exc

    def receive(self, timeout_ms: int = 0) -> list[tuple[str, bytes]]:
        """Every reply waiting now (or within ``timeout_ms``), as (address, payload)."""
        if not self._socks:
            return []
        out = []
        events = dict(self._poller.poll(timeout_ms))
        for address, sock in self._socks.items():
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out.append((address, frames[-1]))
        return out

    def drop(self, addresses: Iterable[str]) -> None:
        """Close the sockets of peers we are done with (replies that arrive later are lost)."""
        for address in addresses:
            sock = self._socks.pop(address, None)
            if sock is not None:
                self._poller.unregister(sock)
                sock.close(0)

    def close(self) -> None:
        self.drop(list(self._socks))
        self._ctx.term()
