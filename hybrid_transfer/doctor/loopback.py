"""Two-process loopback READ for ``doctor``: a source and a reader process, each with its own NIXL agent.

The reader runs with ``UCX_PROTO_INFO=y`` and ``UCX_LOG_FILE`` pointing into a temporary folder, so the
protocol UCX selected for the READ (and its transport) can be read back afterwards
(``ucx_tables``). UCX prints a table once, when it first selects a protocol: the first (warm-up)
READ pays for that and for connection set-up, the timed READs after it do not.

Both children reach NIXL only through the engine's ``NixlAgent`` (built on the NIXL module the parent
resolved, e.g. ``nixl_cu13._api``: the ``nixl`` meta package imports all of torch on a CPU-only torch to
look for a CUDA version), and import neither the producer nor the consumer, so no torch either unless a
VRAM run allocates GPU memory. A timed READ includes building its handle (``post_read``), about 0.1 ms.
Parent and children talk over the children's stdin/stdout in length-prefixed msgpack frames of typed
messages; each child first moves its fd 1 onto fd 2, because UCX and NIXL's Python logger write to stdout.
"""

from __future__ import annotations

import enum
import glob
import logging
import os
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

log = logging.getLogger(__name__)

_WORD_BYTES = 8  # the pattern is one int64 per 8 bytes: unique per word, so a shifted copy cannot verify
_PATTERN_BASE = 0x5EED << 40
READER_NAME = "ht-doctor-reader"
SOURCE_NAME = "ht-doctor-source"
_CHILD_MODULE = "hybrid_transfer.doctor.loopback_child"


class Memory(enum.Enum):
    """Memory kind of a loopback run, named as NIXL names the segment."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class LoopbackSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What both processes of one loopback run need (sent to them by the parent)."""

    memory: Memory
    num_bytes: int
    repeats: int  # timed READs after the warm-up READ
    api_module: str  # NIXL module to import, e.g. "nixl_cu13._api"
    reader_device: int = 0
    source_device: int = 0
    deadline_s: float = 60.0  # each process gives up after this long


class SourceOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="offer"):
    """The source's answer to the spec: where its filled buffer is, and its agent's metadata."""

    metadata: bytes
    addr: int
    device_id: int


class ChildFailure(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="failure"):
    """A child could not play its role; ``error`` says why."""

    error: str


class LoopbackResult(msgspec.Struct, frozen=True):
    """Outcome of one loopback run; ``error`` is None when every READ completed and verified."""

    memory: Memory
    num_bytes: int
    verified: bool = False
    error: str | None = None
    gbps: float | None = None  # median of the timed READs
    gbps_samples: tuple[float, ...] = ()
    first_read_s: float | None = None  # warm-up READ: connection set-up and protocol selection included
    reader_device: int = 0
    source_device: int = 0
    ucx_log: str = ""  # the reader's UCX log (protocol tables), "" when not captured

    @property
    def ok(self) -> bool:
        return self.error is None and self.verified


def run_loopback(memory: Memory, num_bytes: int, *, api_module: str = "nixl._api", repeats: int = 5,
                 observe_protocols: bool = True, timeout_s: float = 60.0, reader_device: int = 0,
                 source_device: int = 0) -> LoopbackResult:
    """READ ``num_bytes`` (one descriptor) from a source process into a reader process and verify them."""
    if num_bytes <= 0 or num_bytes % _WORD_BYTES:
        from hybrid_transfer.errors import ConfigError

        raise ConfigError(f"num_bytes={num_bytes} must be a positive multiple of {_WORD_BYTES}", field="num_bytes",
                          value=num_bytes)
    spec = LoopbackSpec(memory=memory, num_bytes=num_bytes, repeats=repeats, api_module=api_module,
                        reader_device=reader_device, source_device=source_device, deadline_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="ht-doctor-") as log_dir:
        reader_env = dict(os.environ)
        if observe_protocols:
            reader_env["UCX_PROTO_INFO"] = "y"
            reader_env["UCX_LOG_FILE"] = os.path.join(log_dir, "ucx-reader.%p.log")  # UCX expands %p
        outcome = _run_pair(spec, reader_env, timeout_s)
        ucx_log = _read_logs(log_dir) if observe_protocols else ""
    return msgspec.structs.replace(outcome, ucx_log=ucx_log)


def _spawn(role: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", _CHILD_MODULE, role], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)


def _run_pair(spec: LoopbackSpec, reader_env: dict[str, str], timeout_s: float) -> LoopbackResult:
    failed = LoopbackResult(memory=spec.memory, num_bytes=spec.num_bytes,
                            reader_device=spec.reader_device, source_device=spec.source_device)
    deadline = time.monotonic() + timeout_s
    source = _spawn("source", dict(os.environ))
    reader = _spawn("reader", reader_env)
    try:
        encoded = msgspec.msgpack.encode(spec)
        for proc in (source, reader):
            try:
                _send_frame(proc.stdin, encoded)
            except OSError:
                pass  # it died at start; the missing answer below reports it
        offer = _recv_frame(source.stdout, deadline)  # a SourceOffer or a ChildFailure, passed on as is
        if offer is None:
            return msgspec.structs.replace(failed, error=_gone("source", source, deadline))
        try:
            _send_frame(reader.stdin, offer)
        except OSError:
            pass  # the reader already gave up; its answer says why
        answer = _recv_frame(reader.stdout, deadline)
        if answer is None:
            return msgspec.structs.replace(failed, error=_gone("reader", reader, deadline))
        try:
            return msgspec.msgpack.decode(answer, type=LoopbackResult)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return msgspec.structs.replace(failed, error=f"the reader's answer does not decode: {exc}")
    finally:
        for proc in (reader, source):
            _close_quietly(proc.stdin)  # the source serves until its stdin closes
        for proc in (reader, source):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("loopback child %d did not exit in time; killing it", proc.pid)
                proc.kill()
                proc.wait()
            _close_quietly(proc.stdout)


def _gone(role: str, proc: subprocess.Popen, deadline: float) -> str:
    if time.monotonic() >= deadline:
        return f"the {role} process did not answer before the deadline"
    return f"the {role} process exited without an answer (exit code {proc.poll()})"


def _close_quietly(stream: Any) -> None:
    try:
        stream.close()
    except OSError:
        pass


def _send_frame(stream: Any, payload: bytes) -> None:
    stream.write(struct.pack(">I", len(payload)) + payload)
    stream.flush()


def _recv_frame(stream: Any, deadline: float | None) -> bytes | None:
    """One frame, or None on EOF or when the deadline passes first."""
    head = _recv_exact(stream, 4, deadline)
    if head is None:
        return None
    return _recv_exact(stream, struct.unpack(">I", head)[0], deadline)


def _recv_exact(stream: Any, size: int, deadline: float | None) -> bytes | None:
    fd = stream.fileno()
    chunks = []
    while size:
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and (timeout <= 0 or not select.select([fd], [], [], timeout)[0]):
            return None
        chunk = os.read(fd, size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_logs(log_dir: str) -> str:
    parts = []
    for path in sorted(glob.glob(os.path.join(log_dir, "*.log"))):
        with open(path, errors="replace") as f:
            parts.append(f.read())
    return "".join(parts)


# ---- child processes (the engine's agent and config, msgspec, numpy; torch for VRAM) --------------------------


class PatternBuffer:
    """One contiguous buffer of int64 words in DRAM (numpy) or VRAM (torch), with the verification pattern.

    It has the attributes NixlAgent.register reads from a cache region (addr, length, device_id, is_cuda).
    """

    def __init__(self, memory: Memory, num_bytes: int, device: int, fill: bool):
        self.memory = memory
        self.length = num_bytes
        self.num_words = num_bytes // _WORD_BYTES
        self.is_cuda = memory is Memory.VRAM
        self.device_id = device if self.is_cuda else 0
        if self.is_cuda:
            import torch

            dev = torch.device("cuda", device)
            self.data = (torch.arange(self.num_words, dtype=torch.int64, device=dev) + _PATTERN_BASE if fill
                         else torch.zeros(self.num_words, dtype=torch.int64, device=dev))
            torch.cuda.synchronize(dev)  # the pattern must be in memory before a peer may read it
            self.addr = self.data.data_ptr()
        else:
            import numpy as np

            self.data = (np.arange(self.num_words, dtype=np.int64) + _PATTERN_BASE if fill
                         else np.zeros(self.num_words, dtype=np.int64))
            self.addr = self.data.ctypes.data

    def clear(self) -> None:
        if self.is_cuda:
            import torch

            self.data.zero_()
            torch.cuda.synchronize(self.data.device)
        else:
            self.data.fill(0)

    def holds_pattern(self) -> bool:
        if self.is_cuda:
            import torch

            expected = torch.arange(self.num_words, dtype=torch.int64, device=self.data.device) + _PATTERN_BASE
            return bool(torch.equal(self.data, expected))
        import numpy as np

        return bool(np.array_equal(self.data, np.arange(self.num_words, dtype=np.int64) + _PATTERN_BASE))

    def descs(self) -> Any:
        import numpy as np

        return np.array([[self.addr, self.length, self.device_id]], dtype=np.int64)


def child_main(role: str) -> None:
    """Entry point of a loopback child: read the spec from stdin, play ``role``, answer on the saved stdout."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # UCX and NIXL's Python logger print to fd 1: keep the frame channel clean
    inp = sys.stdin.buffer
    spec = msgspec.msgpack.decode(_recv_frame(inp, None) or b"", type=LoopbackSpec)
    deadline = time.monotonic() + spec.deadline_s
    if role == "source":
        _source(spec, inp, out, deadline)
    else:
        _reader(spec, inp, out, deadline)


def _make_agent(spec: LoopbackSpec, name: str) -> Any:
    """The engine's agent on the parent's NIXL module; the engine's default config has no progress
    thread, so each process drives UCX itself (the source by polling notifications)."""
    from hybrid_transfer.engine.agent import NixlAgent, quiet_nixl_logging
    from hybrid_transfer.engine.config import EngineConfig

    quiet_nixl_logging(api_module=spec.api_module)  # its INFO lines are noise here
    return NixlAgent(name, EngineConfig(), api_module=spec.api_module)


def _source(spec: LoopbackSpec, inp: Any, out: Any, deadline: float) -> None:
    """Register a filled buffer, offer its metadata, serve READs until stdin closes (or the deadline)."""
    try:
        agent = _make_agent(spec, SOURCE_NAME)
        buf = PatternBuffer(spec.memory, spec.num_bytes, spec.source_device, fill=True)
        agent.register([buf])
        offer = SourceOffer(metadata=agent.metadata, addr=buf.addr, device_id=buf.device_id)
    except Exception as exc:  # noqa: BLE001 - the parent must hear why, whatever it was (typed or from torch)
        _send_frame(out, msgspec.msgpack.encode(ChildFailure(f"source: {type(exc).__name__}: {exc}")))
        return
    _send_frame(out, msgspec.msgpack.encode(offer))
    # Polling notifications progresses UCX on this side: a first READ from a new peer needs the target to
    # answer its connection set-up, and transports without one-sided reads (tcp) need it for every byte.
    fd = inp.fileno()
    try:
        while time.monotonic() < deadline:
            agent.get_notifs()
            if select.select([fd], [], [], 0)[0]:  # the parent closed our stdin: the reader is done
                break
    finally:
        agent.close()


def _reader(spec: LoopbackSpec, inp: Any, out: Any, deadline: float) -> None:
    """READ the source's buffer once to warm up, then ``repeats`` timed times, verifying the bytes."""
    failed = LoopbackResult(memory=spec.memory, num_bytes=spec.num_bytes, reader_device=spec.reader_device,
                            source_device=spec.source_device)
    try:
        outcome = _read_loop(spec, inp, deadline, failed)
    except Exception as exc:  # noqa: BLE001 - the parent must hear why, whatever it was (typed or from torch)
        outcome = msgspec.structs.replace(failed, error=f"reader: {type(exc).__name__}: {exc}")
    _send_frame(out, msgspec.msgpack.encode(outcome))


_OFFER_DECODER = msgspec.msgpack.Decoder(SourceOffer | ChildFailure)


def _read_loop(spec: LoopbackSpec, inp: Any, deadline: float, failed: LoopbackResult) -> LoopbackResult:
    agent = _make_agent(spec, READER_NAME)
    try:
        buf = PatternBuffer(spec.memory, spec.num_bytes, spec.reader_device, fill=False)
        agent.register([buf])
        frame = _recv_frame(inp, deadline)
        if frame is None:
            return msgspec.structs.replace(failed, error="the source's metadata did not arrive in time")
        offer = _OFFER_DECODER.decode(frame)
        if isinstance(offer, ChildFailure):
            return msgspec.structs.replace(failed, error=offer.error)
        import numpy as np

        peer = agent.add_remote(offer.metadata)
        remote = np.array([[offer.addr, spec.num_bytes, offer.device_id]], dtype=np.int64)
        first_s = timed_read(agent, peer, buf.descs(), remote, deadline)
        if not buf.holds_pattern():
            return msgspec.structs.replace(failed, first_read_s=first_s,
                                           error="the warm-up READ completed but the bytes differ from the source's")
        samples = []
        for i in range(spec.repeats):
            if i == spec.repeats - 1:
                buf.clear()  # the last READ must prove itself too
            samples.append(spec.num_bytes / timed_read(agent, peer, buf.descs(), remote, deadline) / 1e9)
        verified = buf.holds_pattern()
        return msgspec.structs.replace(
            failed, verified=verified, first_read_s=first_s, gbps_samples=tuple(samples),
            gbps=statistics.median(samples) if samples else None,
            error=None if verified else "the last READ completed but the bytes differ from the source's")
    finally:
        agent.close()


def timed_read(agent: Any, peer: str, local: Any, remote: Any, deadline: float) -> float:
    """Post one READ and spin until it is DONE; its wall time in seconds.

    Raises:
        EngineError: the READ ended in error, or was still in progress at the deadline.
    """
    from hybrid_transfer.engine.agent import XferState
    from hybrid_transfer.errors import EngineError

    start = time.perf_counter()
    xfer = agent.post_read(peer, local, remote)
    while agent.check(xfer) is XferState.PROC:
        if time.monotonic() > deadline:
            agent.release(xfer)
            raise EngineError("the READ was still in progress at the deadline", operation="READ",
                              agent=agent.name, peer=peer)
    elapsed = time.perf_counter() - start
    if xfer.state is not XferState.DONE:
        raise xfer.error or EngineError(f"the READ ended {xfer.state.value}", operation="READ", agent=agent.name,
                                        peer=peer)
    agent.release(xfer)
    return elapsed
