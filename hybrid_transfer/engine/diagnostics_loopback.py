"""Two-process loopback READ for ``doctor``: a source and a reader process, each with its own NIXL agent.

The reader runs with ``UCX_PROTO_INFO=y`` and ``UCX_LOG_FILE`` pointing into a temporary folder, so the
protocol UCX selected for the READ (and its transport) can be read back afterwards
(``diagnostics_ucx``). UCX prints a table once, when it first selects a protocol: the first (warm-up)
READ pays for that and for connection set-up, the timed READs after it do not.

The children run this file by path (``python -c`` bootstrap), not as ``hybrid_transfer.engine...``:
importing the package would import the whole engine and torch (about 3 s of CPU per process on a
2-core host). So the child half of this module imports only the standard library, msgspec and numpy,
plus the NIXL backend module the parent resolved (e.g. ``nixl_cu13._api``; the ``nixl`` meta package
imports all of torch on a CPU-only torch to look for a CUDA version). A VRAM run imports torch to
allocate GPU memory. Parent and children talk over the children's stdin/stdout in length-prefixed
msgpack frames; each child first moves its fd 1 onto fd 2, because UCX and NIXL's Python logger
write to stdout.
"""

from __future__ import annotations

import enum
import glob
import importlib
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
_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_ht_doctor_loopback', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)\n"
    "mod.child_main(sys.argv[2])\n"
)


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
        raise ValueError(f"num_bytes={num_bytes} must be a positive multiple of {_WORD_BYTES}")
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
    return subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, os.path.abspath(__file__), role],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)


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
        offer = _recv_frame(source.stdout, deadline)  # the source's metadata and buffer, or its error
        if offer is None:
            return msgspec.structs.replace(failed, error=_gone("source", source, deadline))
        try:
            _send_frame(reader.stdin, offer)
        except OSError:
            pass  # the reader already gave up; its answer says why
        answer = _recv_frame(reader.stdout, deadline)
        if answer is None:
            return msgspec.structs.replace(failed, error=_gone("reader", reader, deadline))
        return msgspec.msgpack.decode(answer, type=LoopbackResult)
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


# ---- child processes (standard library, msgspec, numpy, NIXL; torch for VRAM) --------------------------------


class _Buffer:
    """One contiguous buffer of int64 words in DRAM (numpy) or VRAM (torch), with the verification pattern."""

    def __init__(self, memory: Memory, num_bytes: int, device: int, fill: bool):
        self.memory = memory
        self.num_words = num_bytes // _WORD_BYTES
        self.device = device if memory is Memory.VRAM else 0
        if memory is Memory.VRAM:
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
        if self.memory is Memory.VRAM:
            import torch

            self.data.zero_()
            torch.cuda.synchronize(self.data.device)
        else:
            self.data.fill(0)

    def holds_pattern(self) -> bool:
        if self.memory is Memory.VRAM:
            import torch

            expected = torch.arange(self.num_words, dtype=torch.int64, device=self.data.device) + _PATTERN_BASE
            return bool(torch.equal(self.data, expected))
        import numpy as np

        return bool(np.array_equal(self.data, np.arange(self.num_words, dtype=np.int64) + _PATTERN_BASE))


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


def _import_api(spec: LoopbackSpec) -> Any:
    api = importlib.import_module(spec.api_module)
    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines are noise here
    return api


def _make_agent(api: Any, name: str) -> Any:
    # No NIXL progress thread: each process drives UCX itself (the source by polling notifications).
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _source(spec: LoopbackSpec, inp: Any, out: Any, deadline: float) -> None:
    """Register a filled buffer, offer its metadata, serve READs until stdin closes (or the deadline)."""
    try:
        api = _import_api(spec)
        agent = _make_agent(api, SOURCE_NAME)
        buf = _Buffer(spec.memory, spec.num_bytes, spec.source_device, fill=True)
        agent.register_memory(agent.get_reg_descs([(buf.addr, spec.num_bytes, buf.device, "")], spec.memory.value))
        offer = {"metadata": agent.get_agent_metadata(), "addr": buf.addr, "device": buf.device}
    except Exception as exc:
        _send_frame(out, msgspec.msgpack.encode({"error": f"source: {type(exc).__name__}: {exc}"}))
        return
    _send_frame(out, msgspec.msgpack.encode(offer))
    # Polling notifications progresses UCX on this side: a first READ from a new peer needs the target to
    # answer its connection set-up, and transports without one-sided reads (tcp) need it for every byte.
    fd = inp.fileno()
    while time.monotonic() < deadline:
        agent.get_new_notifs()
        if select.select([fd], [], [], 0)[0]:  # the parent closed our stdin: the reader is done
            break


def _reader(spec: LoopbackSpec, inp: Any, out: Any, deadline: float) -> None:
    """READ the source's buffer once to warm up, then ``repeats`` timed times, verifying the bytes."""
    base = {"memory": spec.memory.value, "num_bytes": spec.num_bytes,
            "reader_device": spec.reader_device, "source_device": spec.source_device}
    try:
        outcome = _read_loop(spec, inp, deadline)
    except Exception as exc:
        outcome = {"error": f"reader: {type(exc).__name__}: {exc}"}
    _send_frame(out, msgspec.msgpack.encode({**base, **outcome}))


def _read_loop(spec: LoopbackSpec, inp: Any, deadline: float) -> dict:
    api = _import_api(spec)
    import numpy as np

    agent = _make_agent(api, READER_NAME)
    buf = _Buffer(spec.memory, spec.num_bytes, spec.reader_device, fill=False)
    mem = spec.memory.value
    reg = agent.register_memory(agent.get_reg_descs([(buf.addr, spec.num_bytes, buf.device, "")], mem))
    frame = _recv_frame(inp, deadline)
    if frame is None:
        return {"error": "the source's metadata did not arrive in time"}
    offer = msgspec.msgpack.decode(frame)
    if "error" in offer:
        return {"error": offer["error"]}
    remote_addr, remote_device = offer["addr"], offer["device"]
    peer = agent.add_remote_agent(offer["metadata"])
    local = agent.get_xfer_descs(np.array([[buf.addr, spec.num_bytes, buf.device]], dtype=np.int64), mem)
    remote = agent.get_xfer_descs(np.array([[remote_addr, spec.num_bytes, remote_device]], dtype=np.int64), mem)
    first_s = _timed_read(agent, local, remote, peer, deadline)
    if not buf.holds_pattern():
        return {"error": "the warm-up READ completed but the bytes differ from the source's", "first_read_s": first_s}
    samples = []
    for i in range(spec.repeats):
        if i == spec.repeats - 1:
            buf.clear()  # the last READ must prove itself too
        samples.append(spec.num_bytes / _timed_read(agent, local, remote, peer, deadline) / 1e9)
    verified = buf.holds_pattern()
    out = {"verified": verified, "first_read_s": first_s, "gbps_samples": samples,
           "gbps": statistics.median(samples) if samples else None}
    if not verified:
        out["error"] = "the last READ completed but the bytes differ from the source's"
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)
    return out


def _timed_read(agent: Any, local: Any, remote: Any, peer: str, deadline: float) -> float:
    """Post one READ and spin until it is DONE; its wall time in seconds (raises on ERR or deadline)."""
    handle = agent.initialize_xfer("READ", local, remote, peer)
    start = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError("a READ was still in progress at the deadline")
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - start
    if state != "DONE":
        raise RuntimeError(f"READ ended in state {state}")
    agent.release_xfer_handle(handle)
    return elapsed
