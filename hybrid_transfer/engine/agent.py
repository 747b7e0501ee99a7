"""A thin owner of one NIXL agent (UCX backend): the only module that calls NIXL.

Ownership: NIXL agents are not thread-safe by default (docs/tuning.md#agents). The thread that
creates a NixlAgent is its owner and the only thread that may call it; the
producer's handshake listener never touches it (it serves precomputed bytes). The one exception
is a consumer's posting thread (``post_thread``, engine/poster.py): it creates and posts READs
handed over by ``post_read``, and then every NIXL call of this agent, from either thread, is made
under one lock, so NIXL never sees two calls at once.

Hazards measured here (nixl 1.5.1, CPU DRAM, UCX shared memory):
- ``transfer()`` of a READ between two processes may run the whole copy inside
  the call (UCX's cma zero-copy path): posting is not free on CPU hosts.
- Without NIXL's progress thread the *target* must be progressed too, or a first
  READ from a new peer waits in PROC until the target next calls NIXL (here:
  ``get_notifs``): 11.7 s with a target polling every 5 s.
- A peer process killed with SIGKILL: the next check of a READ on it, a new post and a
  notification to it raise nixlRemoteDisconnectError within milliseconds (UCX sees the
  connection close); the handle then releases. A post can fail after its handle was created:
  the handle is released here, never leaked. Releasing a READ still in PROC succeeds (UCX
  cancels it); NIXL may refuse, and the caller must then try again.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from hybrid_transfer.engine.config import EngineConfig, PrepStrategy, ProgressPolicy
from hybrid_transfer.engine.metrics import Histogram
from hybrid_transfer.engine.nixl_install import quiet_by_default
from hybrid_transfer.engine.poster import Poster
from hybrid_transfer.errors import EngineError, PeerDisconnectedError
from hybrid_transfer.identity_enum import IdentityEnum

if TYPE_CHECKING:  # at run time any object with addr, length, device_id and is_cuda will do (no torch import)
    from hybrid_transfer.cache import Region

log = logging.getLogger(__name__)

_CONFIG_LOCK = threading.Lock()


class XferState(IdentityEnum):
    """One NIXL READ handle."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"
    RELEASED = "RELEASED"  # our own: the handle is freed, nothing can write through it any more

    @classmethod
    def parse(cls, status: str) -> XferState:
        """NIXL's status string ("DONE", "PROC", "ERR")."""
        return {"DONE": cls.DONE, "PROC": cls.PROC}.get(status, cls.ERR)


def _nixl_api(module: str | None = None) -> Any:
    """NIXL's Python API: the ``nixl`` meta package's, or one build's (``nixl_cu13._api``) for the doctor.

    Imported lazily: loading NIXL and UCX costs ~1 s (and the meta package's CUDA probe imports torch).
    """
    quiet_by_default()  # NIXL reads its log level once, on import: INFO lines only when asked for
    if module is not None:
        return importlib.import_module(module)
    import nixl._api as api

    return api


def quiet_nixl_logging(level: str = "WARNING", api_module: str | None = None) -> None:
    """Keep NIXL's Python logger at ``level`` or above (it sets itself to INFO on import: a line per agent).

    ``api_module``: a build's API module (``nixl_cu13._api``) to import instead of the meta package's.
    """
    _nixl_api(api_module)  # the import applies NIXL's own logging config; override it afterwards
    logging.getLogger("nixl").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def _nixl_errors(api: Any) -> tuple[type[BaseException], ...]:
    bind = api.nixlBind
    found = tuple(getattr(bind, n) for n in dir(bind) if n.startswith("nixl") and n.endswith("Error"))
    return found + (RuntimeError, ValueError, TypeError)


@contextmanager
def _progress_delay(api: Any, delay_us: int):
    """Make nixl_agent honour a progress-thread delay.

    nixl 1.5.1's Python wrapper hard-codes ``pthrDelay = 0`` (a busy-spinning thread). For the
    duration of one agent construction, the bindings' config class is swapped for a subclass
    whose ``pthrDelay`` setter writes our value instead.
    """
    base = api.nixlBind.nixlAgentConfig
    field = base.pthrDelay

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self):  # noqa: N802 (binding's name)
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value):  # noqa: N802
            field.__set__(self, delay_us)

    with _CONFIG_LOCK:
        api.nixlBind.nixlAgentConfig = _DelayedConfig
        try:
            yield
        finally:
            api.nixlBind.nixlAgentConfig = base


class XferHandle:
    """One posted READ: the NIXL handle, its peer and its last known state."""

    __slots__ = ("handle", "peer", "state", "num_descriptors", "num_bytes", "_dlists", "error", "checked_in",
                 "posted", "cancelled", "descs", "shares")

    def __init__(self, handle: Any, peer: str, num_descriptors: int, num_bytes: int, dlists: tuple = ()):
        self.handle = handle
        self.peer = peer
        self.state = XferState.PROC
        self.num_descriptors = num_descriptors
        self.num_bytes = num_bytes
        self._dlists = dlists
        self.error: EngineError | None = None  # why the state became ERR, when NIXL raised instead of saying
        self.checked_in = -1  # the agent's check scope that last asked NIXL (one_check_per_handle)
        self.posted = True  # False while it waits for (or is in) the posting thread: NIXL is not asked about it
        self.cancelled = False  # released before it was posted: the posting thread skips it
        self.descs: tuple | None = None  # (local, remote) until the posting thread has posted it
        self.shares = 0  # SharedRead views not yet let go (a READ batched over several requests)

    @property
    def is_released(self) -> bool:
        return self.state is XferState.RELEASED


class SharedRead:
    """One request's part of a READ that several requests share (engine/read_batch.py).

    Its state, peer and error are the shared handle's (an error fails every request in it); its bytes and
    descriptors are the request's own. ``NixlAgent.release`` lets go of this request's reference and frees
    the handle once every request sharing it has let go, so a request that ends early keeps its blocks
    quarantined until the shared handle is released (reference-counted per handle).
    """

    __slots__ = ("base", "num_bytes", "num_descriptors", "dropped")

    def __init__(self, base: XferHandle, num_descriptors: int, num_bytes: int):
        self.base = base
        self.num_descriptors = num_descriptors
        self.num_bytes = num_bytes
        self.dropped = False
        base.shares += 1

    @property
    def peer(self) -> str:
        return self.base.peer

    @property
    def state(self) -> XferState:
        return self.base.state

    @property
    def error(self) -> EngineError | None:
        return self.base.error

    @property
    def is_released(self) -> bool:
        return self.base.is_released


class _NixlCall:
    """The context of one NIXL call (NixlAgent._wrap): a class, not a generator, as every READ post, check,
    release and notification enters one; it costs a few microseconds less a call.

    Enter: EngineError when the agent is closed; True, or False without calling when ``wait`` is False and
    the posting thread holds the lock. Exit: releases the lock if taken, and (with an operation) re-raises
    NIXL's errors as EngineError, PeerDisconnectedError for a disconnected peer.
    """

    __slots__ = ("_agent", "_operation", "_peer", "_wait", "_held")

    def __init__(self, agent: NixlAgent, operation: str | None, peer: str | None, wait: bool):
        self._agent, self._operation, self._peer, self._wait, self._held = agent, operation, peer, wait, False

    def __enter__(self) -> bool:
        agent = self._agent
        if self._operation is not None and agent._closed:
            raise EngineError("the agent is closed", operation=self._operation, agent=agent.name, peer=self._peer)
        if agent._poster is None:
            return True
        self._held = agent._guard.acquire(blocking=self._wait)
        return self._held

    def __exit__(self, exc_type, exc, tb) -> bool:
        agent = self._agent
        if self._held:
            self._held = False
            agent._guard.release()
        if exc is None or self._operation is None or isinstance(exc, EngineError):
            return False
        if isinstance(exc, agent._errors):
            cls = PeerDisconnectedError if type(exc).__name__ == "nixlRemoteDisconnectError" else EngineError
            raise cls(f"{type(exc).__name__}: {exc}", operation=self._operation, agent=agent.name,
                      peer=self._peer) from exc
        return False


class NixlAgent:
    """One rank's NIXL agent: registered cache regions, remote peers, READs and notifications.

    Owned by the thread that creates it (see module docstring). ``close()`` is idempotent.
    """

    def __init__(self, name: str, config: EngineConfig, *, api_module: str | None = None,
                 device_memory: bool = False, post_thread: bool = False,
                 thread_init: Callable[[], None] | None = None):
        api = _nixl_api(api_module)
        self._errors = _nixl_errors(api)
        self.name = name
        self.config = config
        self._closed = False
        self._reg_descs: Any = None
        self._more_descs: list[Any] = []  # register_more: pack mode's staging pools
        self._mem_type = "DRAM"
        self._peers: set[str] = set()
        self._live: set[XferHandle] = set()  # created and not yet released: what could still write
        self._scope = -1  # inside one_check_per_handle: its number; else -1 (every check asks NIXL)
        self._scopes = 0
        self.fetch_time = Histogram()  # seconds inside NIXL's notification fetch, per call (get_notifs)
        self.num_fetched = 0  # notifications NIXL handed over
        use_thread = config.progress is ProgressPolicy.ON_WITH_DELAY
        # The UCX backend is created below, not by the agent's config: its thread-pool parameters depend on
        # the memory the agent moves (``device_memory``, config.py), and split_batch_size is only reachable
        # through create_backend.
        # A posting thread means two threads call this agent (never at once: our lock): tell NIXL, so the
        # backend it creates is prepared for calls from more than one thread.
        sync = {"sync_mode": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT} if post_thread else {}
        conf = api.nixl_agent_config(enable_prog_thread=use_thread, backends=[], **sync)
        try:
            with _progress_delay(api, config.progress_delay_us):
                self._agent = api.nixl_agent(name, conf)
        except self._errors as exc:
            raise EngineError(str(exc), operation="create agent", agent=name) from exc
        plugins = sorted(self._agent.get_plugin_list())
        if "UCX" not in plugins:
            raise EngineError(f"no UCX plugin was found (plugins: {plugins})", operation="create agent", agent=name)
        self.backend_params = self._create_backend(device_memory)  # what the UCX backend was created with
        # With a posting thread every NIXL call takes this lock (module docstring); without, a no-op context.
        self._guard = threading.RLock() if post_thread else nullcontext()
        self._poster = Poster(name, self._post_queued, thread_init=thread_init) if post_thread else None

    @property
    def has_post_thread(self) -> bool:
        return self._poster is not None

    def _create_backend(self, device_memory: bool) -> dict[str, str]:
        """The UCX backend, with the thread-pool parameters for this memory kind (config.py)."""
        params = self.config.backend_params(device_memory)
        try:
            self._agent.create_backend("UCX", params)
        except self._errors as exc:
            raise EngineError(f"the UCX plugin loaded but did not come up (parameters {params}): {exc}",
                              operation="create agent", agent=self.name) from exc
        if "UCX" not in self._agent.backends:
            raise EngineError(f"the UCX plugin loaded but did not come up (parameters {params})",
                              operation="create agent", agent=self.name)
        log.debug("agent %s: UCX backend %s", self.name, params or "with NIXL's defaults")
        return params

    # ---- what NIXL loaded (the doctor reports it) -----------------------------------------
    @property
    def plugins(self) -> list[str]:
        with self._wrap("get plugin list"):
            return sorted(self._agent.get_plugin_list())

    @property
    def backends(self) -> list[str]:
        """Backends created (UCX, at construction)."""
        return sorted(self._agent.backends)

    def mem_types(self, backend: str = "UCX") -> list[str]:
        """Memory segment types ``backend`` can move (DRAM_SEG, VRAM_SEG, ...)."""
        with self._wrap("get backend memory types"):
            return sorted(self._agent.get_backend_mem_types(backend))

    # ---- memory -------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> None:
        """Register each region (a whole shared tensor) once; agent metadata grows per region (docs/tuning.md#agents)."""
        if self._reg_descs is not None:
            raise EngineError("regions are already registered", operation="register", agent=self.name)
        kinds = {r.is_cuda for r in regions}
        if len(kinds) != 1:
            raise EngineError("regions mix host and device memory", operation="register", agent=self.name)
        self._mem_type = "VRAM" if kinds.pop() else "DRAM"
        rows = [(r.addr, r.length, r.device_id, "") for r in regions]
        with self._wrap("register"):
            self._reg_descs = self._agent.register_memory(self._agent.get_reg_descs(rows, self._mem_type))

    def register_more(self, regions: Sequence[Region]) -> None:
        """Register further whole tensors of the cache's memory kind (staging pools), after ``register``.

        Peers see them only in metadata read afterwards: producers call this before the handshake card is built.
        """
        if self._reg_descs is None:
            raise EngineError("register the cache before further regions", operation="register", agent=self.name)
        if any(r.is_cuda != (self._mem_type == "VRAM") for r in regions):
            raise EngineError(f"further regions must be {self._mem_type} like the cache", operation="register",
                              agent=self.name)
        rows = [(r.addr, r.length, r.device_id, "") for r in regions]
        with self._wrap("register"):
            self._more_descs.append(self._agent.register_memory(self._agent.get_reg_descs(rows, self._mem_type)))

    @property
    def metadata(self) -> bytes:
        """This agent's full metadata (connection info + registered regions) for its peers."""
        with self._wrap("get metadata"):
            return self._agent.get_agent_metadata()

    # ---- peers --------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        with self._wrap("add remote agent"):
            peer = self._agent.add_remote_agent(metadata)
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self._peers.add(peer)
        return peer

    def remove_remote(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            with self._wrap("remove remote agent", peer):
                self._agent.remove_remote_agent(peer)

    # ---- reads --------------------------------------------------------------------
    def post_read(self, peer: str, local_descs: np.ndarray, remote_descs: np.ndarray) -> XferHandle:
        """Create and post one READ of ``remote_descs`` on ``peer`` into ``local_descs`` (Nx3 int64 arrays).

        On CPU hosts the copy may complete inside this call (see module docstring). With a posting
        thread the READ is handed over instead and this returns at once: a failure to create or post
        it then shows as the handle's ERR state (with ``error``) at a later ``check``.
        """
        n = int(local_descs.shape[0])
        num_bytes = int(local_descs[:, 1].sum()) if n else 0
        local, remote = np.ascontiguousarray(local_descs), np.ascontiguousarray(remote_descs)
        if self._poster is not None:
            if self._closed:
                raise EngineError("the agent is closed", operation="post READ", agent=self.name, peer=peer)
            xfer = XferHandle(None, peer, n, num_bytes)
            xfer.posted, xfer.descs = False, (local, remote)
            self._live.add(xfer)
            try:
                self._poster.submit(xfer)
            except EngineError:
                self._live.discard(xfer)
                xfer.state = XferState.RELEASED
                raise
            return xfer
        xfer: XferHandle | None = None
        try:
            with self._wrap("post READ", peer):
                handle, dlists = self._create(peer, local, remote)
                xfer = XferHandle(handle, peer, n, num_bytes, dlists)
                self._live.add(xfer)
                xfer.state = XferState.parse(self._agent.transfer(handle))
        except EngineError:
            if xfer is not None:
                xfer.state = XferState.ERR
                if not self.release(xfer):
                    log.warning("agent %s: a READ on %s that failed to post is not released yet", self.name, peer)
            raise
        return xfer

    def _create(self, peer: str, local: np.ndarray, remote: np.ndarray) -> tuple[Any, tuple]:
        """NIXL's READ handle over two descriptor arrays (and the prepared lists to free with it)."""
        if self.config.prep is PrepStrategy.DIRECT:
            handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, self._mem_type),
                                                 self._agent.get_xfer_descs(remote, self._mem_type), peer)
            return handle, ()
        local_h = self._agent.prep_xfer_dlist("", local, self._mem_type)
        remote_h = self._agent.prep_xfer_dlist(peer, remote, self._mem_type)
        index = np.arange(local.shape[0], dtype=np.int32)
        return self._agent.make_prepped_xfer("READ", local_h, index, remote_h, index), (local_h, remote_h)

    def _post_queued(self, xfer: XferHandle) -> None:
        """On the posting thread: create and post one handed-over READ; never raises (errors go on the handle)."""
        state, error = XferState.ERR, None
        try:
            if xfer.cancelled:
                error = EngineError("released before it was posted", operation="post READ", agent=self.name,
                                    peer=xfer.peer)
            elif self._poster.init_error is not None:
                error = EngineError(f"the posting thread could not start: {self._poster.init_error}",
                                    operation="post READ", agent=self.name, peer=xfer.peer)
            else:
                local, remote = xfer.descs
                with self._wrap("post READ", xfer.peer):
                    xfer.handle, xfer._dlists = self._create(xfer.peer, local, remote)
                    state = XferState.parse(self._agent.transfer(xfer.handle))
        except EngineError as exc:
            error = exc
        except BaseException as exc:  # a bug must not kill the thread silently: the READ fails loudly
            log.exception("agent %s: posting a READ on %s failed", self.name, xfer.peer)
            error = EngineError(f"{type(exc).__name__}: {exc}", operation="post READ", agent=self.name,
                                peer=xfer.peer)
        xfer.descs = None
        xfer.state, xfer.error = state, error
        xfer.posted = True  # last: the owner reads state and error only once this is set

    @property
    def num_live_handles(self) -> int:
        """READ handles created by this agent and not yet released (each one could still write)."""
        return len(self._live)

    def unreleased(self) -> list[XferHandle]:
        """The live handles (a post that failed and whose release NIXL refused included)."""
        return list(self._live)

    def check(self, xfer: XferHandle) -> XferState:
        """Progress NIXL and return the READ's state (sticky once DONE or ERR).

        A NIXL error (the peer disconnected, ...) makes the state ERR with ``xfer.error`` set.
        """
        if isinstance(xfer, SharedRead):
            xfer = xfer.base
        if xfer.state is XferState.PROC and xfer.posted and (self._scope < 0 or xfer.checked_in != self._scope):
            try:
                with self._wrap("check transfer", xfer.peer, wait=False) as called:
                    if called:  # else the posting thread is mid-post: asked again at the next check
                        xfer.checked_in = self._scope
                        xfer.state = XferState.parse(self._agent.check_xfer_state(xfer.handle))
            except EngineError as exc:
                xfer.state, xfer.error = XferState.ERR, exc
        return xfer.state

    @property
    def check_scope(self) -> int:
        """The number of the one_check_per_handle block being run, or -1 outside one (for the mapped reads'
        checks, engine/mapped/transport.py, which follow the same rule)."""
        return self._scope

    @contextmanager
    def one_check_per_handle(self):
        """Within this block each READ's state is asked of NIXL at most once (a consumer's poll: its pack
        reader and its own loop both look at a request's handles). Outside it every check asks."""
        self._scopes += 1
        self._scope = self._scopes
        try:
            yield
        finally:
            self._scope = -1

    def release(self, xfer: XferHandle) -> bool:
        """Free a READ's handle; False when NIXL refuses because the READ may still write (try again later).

        A READ still waiting for the posting thread is cancelled (it will not be posted) and False is
        returned: it may be mid-post; a later call frees it once the thread is done with it. A SharedRead
        lets go of its request's reference; the shared READ is freed (True) once no request holds it.
        """
        if isinstance(xfer, SharedRead):
            if not xfer.dropped:
                xfer.dropped = True
                xfer.base.shares -= 1
            if xfer.base.shares > 0:
                return False
            xfer = xfer.base
        if xfer.is_released:
            return True
        if not xfer.posted:
            xfer.cancelled = True
            return False
        if xfer.handle is not None:
            with self._locked(wait=False) as locked:
                if not locked:
                    return False  # the posting thread is mid-post: freed at a later call, never waited for
                try:
                    self._agent.release_xfer_handle(xfer.handle)
                except self._errors as exc:
                    log.debug("release of a READ on %s refused: %s", xfer.peer, exc)
                    return False
                for dlist in xfer._dlists:
                    try:
                        self._agent.release_dlist_handle(dlist)
                    except self._errors as exc:
                        log.warning("agent %s: releasing a descriptor list on %s failed: %s", self.name, xfer.peer,
                                    exc)
        self._live.discard(xfer)
        xfer.state = XferState.RELEASED
        xfer._dlists = ()
        return True

    # ---- notifications ------------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        with self._wrap("send notification", peer):
            self._agent.send_notif(peer, message)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name; also progresses NIXL (the target side of READs).

        NIXL hands over everything it buffered in one call, with no cap we can set; the time spent inside
        that call is recorded apart (``fetch_time``, in the owner's ``metrics()``) and the count in
        ``num_fetched``, so a flood shows as NIXL's time, not as the engine's (docs/metrics.md).
        """
        with self._wrap("get notifications", wait=False) as called:
            if not called:  # the posting thread is mid-post: NIXL keeps them for the next poll
                return {}
            start = time.perf_counter()
            notifs = self._agent.get_new_notifs()
            self.fetch_time.observe(time.perf_counter() - start)
        out = {(k.decode() if isinstance(k, bytes) else str(k)): v if type(v) is list else list(v)
               for k, v in notifs.items()}
        self.num_fetched += sum(len(v) for v in out.values())
        return out

    # ---- teardown -----------------------------------------------------------------
    def close(self) -> None:
        """Release what READ handles NIXL lets go of, forget peers, deregister memory; idempotent."""
        if self._closed:
            return
        if self._poster is not None:  # nothing queued is posted any more; what is mid-post finishes first
            for xfer in self._live:
                xfer.cancelled = True
            self._poster.close()
        for xfer in list(self._live):
            if not self.release(xfer):
                log.warning("agent %s closes with a READ on %s it could not release", self.name, xfer.peer)
        for peer in list(self._peers):
            try:
                self.remove_remote(peer)
            except EngineError as exc:
                log.warning("%s", exc)
        with self._locked():
            for descs in self._more_descs:
                try:
                    self._agent.deregister_memory(descs)
                except self._errors as exc:
                    log.warning("deregistering staging of agent %s failed: %s", self.name, exc)
            self._more_descs = []
            if self._reg_descs is not None:
                try:
                    self._agent.deregister_memory(self._reg_descs)
                except self._errors as exc:
                    log.warning("deregistering memory of agent %s failed: %s", self.name, exc)
                self._reg_descs = None
        self._closed = True

    def _wrap(self, operation: str, peer: str | None = None, *, wait: bool = True) -> _NixlCall:
        """One NIXL call under the agent's lock, its errors typed. ``wait=False``: when the posting thread holds
        the lock (mid-post), yield False at once and call nothing: a poll never waits for a post."""
        return _NixlCall(self, operation, peer, wait)

    def _locked(self, wait: bool = True) -> _NixlCall:
        """The agent's lock (only with a posting thread; without one a single thread calls NIXL): True once
        held; with ``wait=False``, False at once while the posting thread holds it. Errors pass untyped."""
        return _NixlCall(self, None, None, wait)
