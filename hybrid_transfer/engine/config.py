"""The engine's one configuration struct, with documented defaults, validated at start.

Progress thread (docs/tuning.md#progress-thread), measured with ``benchmarks/progress_thread.py`` (2-core CPU host,
2 processes, 256 MiB READ of 16 MiB descriptors / 64 MiB of 16 KiB descriptors with gaps, the
target polling every 10 ms like an engine step; two runs, GB/s large / small, cores used):

  policy          large GB/s   small GB/s   initiator cores  target cores  idle cores
  OFF             4.54, 4.64   2.18, 2.36   0.98, 0.92       0.03, 0.03    0.00
  ON, delay 0     1.07, 1.70   0.42, 0.71   0.44, 0.66       0.18, 0.38    0.27-0.99
  ON, 100 us      1.56, 4.52   2.16, 2.38   0.74, 1.79       0.04, 0.06    0.02-0.04
  ON, 1000 us     2.33, 2.63   1.06, 1.11   0.79, 0.94       0.05, 0.05    0.02-0.04

OFF is the default: the highest and steadiest throughput and no CPU when idle. Its price: the
target must be progressed, which Producer.poll() does; a first READ from a new peer waits for
the producer's next poll (58-85 ms above, with 10 ms polls; 11.7 s with 5 s polls). Embedders
that cannot poll producers regularly should pick ON_WITH_DELAY with 100-1000 us.

Descriptor preparation, measured with ``benchmarks/prep_strategy.py`` (qwen3.5-0.8b TP1 -> TP1,
8192 tokens = 114.6 MiB, contiguous / fragmented, median of 15): building the handle took
direct 0.13-0.16 ms, prepped 0.18-0.19 ms, per-peer lists 0.04-0.06 ms (+0.02-0.03 ms index
lookup); post-to-DONE was 25-28 ms for all three (the copy dominates on CPU). Per-peer lists
only work when every planned range is an entry of a list prepared per block in advance, which
fails as soon as the two sides' block sizes differ (pieces end at arbitrary tokens); DIRECT is
general and faster than per-request prepared lists, so it is the default.

UCX thread-pool engine (``num_backend_threads``, ``split_batch_size``): on GPU caches every
descriptor costs UCX's ``cuda_ipc`` about 6 us of CPU work in one worker (docs/benchmarks.md), so
a request of 100-750 descriptors is CPU-bound. UCX's thread pool splits a request into tasks of
``split_batch_size`` descriptors over ``num_threads`` threads. Measured on one H200 (16 cores),
qwen3.5-397b-a17b, 8192 tokens, GB/s of the direct (coalesced) path (docs/benchmarks.md, "Issue 13"):

  threads / split   P1->D1 frag 0 / 1, one rank     P1->D1 frag 0 / 1     P2->D8 frag 1 (8 ranks
                    (ucx_threads.py, 16 requests)   (bench, 8 requests)   on one GPU, bench)
  0 (one worker)    314 / 331                       372 / 218             76   (ovh 15.4 ms)
  2 / 16            432 / 434
  4 / 8             492 / 532
  4 / 16            586 / 466                       391 / 368             112  (ovh 7.3 ms)
  4 / 32            612 / 402
  8 / 16            604 / 522                       310 / 355             86   (ovh 11.7 ms)
  8 / 32            522 / 595

With one decode rank 4-8 threads and splits of 16-32 are within round-to-round noise; with eight
decode ranks sharing 16 cores, 8 threads each oversubscribe them (decode CPU 1.63 s against 1.20 s)
and lose. So GPU caches get 4 threads and splits of 16 (GPU_BACKEND_DEFAULTS). On CPU hosts (DRAM,
``cma``) the copy itself runs in the posting thread and the 2-core hosts have no cores to spare,
so host caches keep one worker (HOST_BACKEND_DEFAULTS, the setting of the CPU tables).

Pack mode (issue 6): producers gather each held request into a staging pool at hold() time, in
a canonical order (plan/stage_layout.py) that makes every consumer rank's share at most two
ranges per source; consumers read those and scatter them. When a request does not fit a pool
(the producer's at hold(), the consumer's when the READ is posted), that source is read directly,
counted, never delayed: waiting for space would tie one request's latency to other requests'
completions (and, on the producer, cannot happen inside hold()), while direct reads are always
correct. ``auto`` chooses once per request shape, for every source of the plan, with plan/cost.py's model:
its GPU or host preset by the cache's memory unless ``cost`` gives the parameters (or ``calibrate`` asks
for a measurement at consumer start, engine/pack/calibrate.py; docs/planner.md#auto says why that is off).
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from hybrid_transfer.engine.addresses import DEFAULT_ALLOWED_PRODUCERS, AllowedProducers
from hybrid_transfer.engine.wire import MAX_MESSAGE_BYTES
from hybrid_transfer.errors import ConfigError, echo
from hybrid_transfer.plan.types import PlanMode


class ProgressPolicy(enum.Enum):
    """Who drives NIXL's (UCX's) progress engine."""

    OFF = "off"  # no NIXL thread: every poll() progresses the agent (a target that never polls stalls a first READ)
    ON_WITH_DELAY = "on"  # NIXL's own thread, sleeping progress_delay_us between rounds (0: busy-spins a core)


class PrepStrategy(enum.Enum):
    """How a plan's Nx3 descriptor arrays become a NIXL transfer."""

    DIRECT = "direct"  # initialize_xfer on the plan's arrays: no prepared-list round trip
    PREPPED = "prepped"  # prep_xfer_dlist per request + make_prepped_xfer over all indices (NIXL may merge)


_STAGING_MODES = (PlanMode.PACK, PlanMode.AUTO)
# (num_threads, split_batch_size) of the UCX backend when the config leaves them None; see the module docstring.
GPU_BACKEND_DEFAULTS: tuple[int, int | None] = (4, 16)
HOST_BACKEND_DEFAULTS: tuple[int, int | None] = (0, None)
# Consumer posting thread when the config leaves it None (docs/tuning.md#posting-thread): off on both. Measured on
# one H200 (P1->D1, 16 requests, 4 in flight) it did not beat posting on the owner thread (406 against 456 GB/s
# for fragmentation 0) and fragmented rounds stalled for 40-67 ms; on the 2-core CPU hosts the copy runs inside
# the post and there is no core to spare.
GPU_POST_THREAD = False
HOST_POST_THREAD = False
# A producer rank's cap on pinned blocks when max_held_blocks is None: held requests are finished prefills waiting
# for their readers, so under honest load they are a small share of the cache. A tenth stays for the engine's running
# prefills even when clients ask for remote decode and nobody reads: at serving sizes (tens of thousands of blocks)
# that is several steps of max_num_batched_tokens (docs/limits.md#held-blocks).
DEFAULT_HELD_FRACTION = 0.9
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "*"})  # bind hosts that mean "every interface"


READ_BATCHING = ("per_step", "per_request")  # EngineConfig.read_batching
READ_TRANSPORTS = ("auto", "nixl", "mapped")  # EngineConfig.read_transport (engine/mapped/, docs/tuning.md#mapped-reads)


class CostParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Auto mode's cost model parameters (plan/cost.py); defaults: the H200 figures of docs/tuning.md#cost-model."""

    per_descriptor_s: float = 7.5e-6
    per_byte_s: float = 1.0 / 1.755e12
    copy_per_byte_s: float = 1.0 / 2.13e12
    per_piece_copy_s: float = 2e-8
    copy_launch_s: float = 1e-5
    pack_fixed_s: float = 1.5e-3


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Settings shared by producers and consumers; every field has a default that works on loopback.

    side_channel_host / side_channel_port: where a producer's handshake listener binds (port 0 picks a
        free port; read it back from ``Producer.address``). A wildcard (0.0.0.0, ::, *) binds every
        interface and then needs ``advertise_host``.
    advertise_host: the host name or address of this rank that tickets and handshake replies give
        to consumers (with the bound port); None: side_channel_host, which must then not be a wildcard.
    handshake_timeout_s: how long a consumer waits for every rank of a producer engine to answer.
    read_deadline_s: how long a consumer request may wait for handshakes and its READs before it fails.
    lease_s: how long a producer pins a request's blocks, on its own clock; carried in tickets.
        At expiry the blocks are freed and the ticket revoked; consumer heartbeats push it back.
    heartbeat_interval_s: how often a consumer renews the leases of the requests it waits for or
        reads (one NIXL notification per producer rank per interval); must be below lease_s.
        None: min(5 s, lease_s / 4) (``heartbeat_every_s``).
    progress: who progresses NIXL; see the measured figures in this module's docstring.
    progress_delay_us: sleep of NIXL's progress thread between rounds (ON_WITH_DELAY only).
    num_backend_threads: threads of UCX's thread-pool engine (UCX's ``num_threads``; 0: one worker, no pool).
        None: chosen by the cache's memory (GPU_BACKEND_DEFAULTS or HOST_BACKEND_DEFAULTS, measured below).
    split_batch_size: descriptors per thread-pool task (UCX's ``split_batch_size``; only reachable through
        ``create_backend``, not NIXL's agent config). UCX's own default (1024) leaves every realistic
        request on one thread. None: chosen by the cache's memory like num_backend_threads.
    mode: plan mode of the consumer's reads: coalesced, naive, pack (through staging, see above) or
        auto (per source, pack when the cost model expects it to be faster). Producers stage the
        requests they hold only in pack and auto.
    staging_bytes: each rank's registered staging pool (pack and auto only). A producer rank holds
        a staged copy of its bytes of every held request until it is freed; a consumer rank needs
        the bytes of its reads in flight. What does not fit is read directly (see above).
    cost: auto mode's cost parameters; None: plan/cost.py's preset for the cache's memory (GPU or host),
        or a calibration when ``calibrate`` is on.
    calibrate: in auto mode without ``cost``, time loopback READs and gathers at consumer start (~0.1-0.5 s)
        and plan with those figures. Off by default: each rank measures its own, noisy figures, so ranks
        and restarts chose differently for one shape (docs/planner.md#auto).
    prep: how descriptors reach NIXL; see the measured figures in this module's docstring.
    early_completion_grace_s: how long a producer rank keeps a completion that arrives before the
        request's ``hold()`` (a serving engine holds at its next step; engine/lifecycle/early.py). Completions
        announced with ``Producer.expect`` are kept for a whole lease instead.
    early_completion_limit: at most this many such completions are kept per producer rank (the
        oldest go first, counted in ``ProducerStats.early_evicted``).
    max_pending_handshakes: consumer agents a producer rank remembers between their handshake and their
        Hello; beyond it the oldest is forgotten (a flood of handshakes cannot grow memory).
    pending_handshake_s: how long a producer rank waits for a Hello after a handshake, on its own clock.
    notifications_per_poll: NIXL notifications one poll() decodes and acts on; the rest wait for the
        next poll (engine/inbox.py), so a flood cannot stall the owner's loop.
    notification_backlog_bytes: notifications carried over to later polls, at most; what arrives beyond
        it is dropped and counted (at least MAX_MESSAGE_BYTES, so any message of ours fits).
    secret_file: a file holding the shared secret that authenticates handshakes and notifications
        (engine/auth.py, docs/security.md); None: the ``HYBRID_TRANSFER_SECRET`` environment variable,
        and without either nothing is authenticated (one warning at start). The path is a setting, the
        secret never is: it is read at start and never logged.
    side_channel_curve: encrypt the side channel (handshakes, pack-mode staging queries) with ZeroMQ
        CURVE, the server key derived from the shared secret, which it therefore needs; every rank of
        both engines must agree. Cache bytes over NIXL stay unencrypted (docs/security.md).
    post_thread: a consumer rank creates and posts its READs on a second thread (engine/poster.py), so its
        own thread plans and polls while UCX posts (docs/tuning.md#posting-thread). None: off for both
        GPU and host caches (GPU_POST_THREAD / HOST_POST_THREAD: measured, it did not help).
    peer_probe_s: how often a producer rank checks, on its own clock, that the consumer agents which
        claimed a request it still holds are alive (one NIXL notification each; docs/lifecycle.md,
        "Fast reclaim"). NIXL reporting one disconnected ends its requests at once instead of at the
        lease. 0 turns the check off: the lease is then the only way back for a dead consumer's blocks.
    max_held_blocks: at most this many blocks a producer rank keeps pinned for holds (ended ones waiting
        for their step fences included); a ``hold()`` that would pin more raises HoldCapacityError before
        pinning anything (docs/limits.md#held-blocks). None: 90% of the rank's cache blocks
        (DEFAULT_HELD_FRACTION), so tickets nobody reads cannot take the whole cache a prefill engine runs on.
    allowed_producers: the producers a consumer may connect to (engine/addresses.py): each entry a host
        name, an address or a CIDR (IPv6 in brackets when it has ports), optionally ``:PORT`` or
        ``:FIRST-LAST`` ("10.1.2.0/24:5600-5700", "prefill-0.example:5600"); names are compared as
        written, never resolved. A ticket naming another address fails before any connect
        (ProducerNotAllowedError): without a secret anyone can compute a ticket's MAC, so the ticket
        must not decide where a consumer connects (docs/security.md#allowed-producers). Default: loopback.
    max_links: producer engines a consumer keeps links to; beyond it the least recently used failed link
        is evicted, and a ticket for a new engine fails (cause "capacity") when every link is live.
    max_handshake_sockets: handshakes a consumer has in flight, one ZeroMQ socket per producer rank
        address, closed when the reply comes or the handshake times out; a ticket that would need more fails
        (cause "capacity") before connecting (docs/limits.md#consumer-links).
    read_batching: how a consumer rank's ``start_reads`` posts a step's requests (docs/lifecycle.md#batched-reads):
        "per_step" (one READ per producer agent for every direct source of the step, one Claims per agent
        per step, one Completions per agent per poll) or "per_request" (each request alone, as ``start_read``).
    read_transport: how a consumer reads from each producer agent, chosen per link at the handshake
        (engine/mapped/, docs/tuning.md#mapped-reads): "auto" maps the producer's cache (shared memory of a
        cache the library allocated, CUDA IPC of a GPU cache) when both ranks are on one host, both can open
        that kind and a shared secret authenticated the handshake, else reads over NIXL; "nixl" never maps
        (a producer with it offers no handles); "mapped" fails a link that cannot be mapped (cause
        "incompatible") instead of falling back.
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    advertise_host: str | None = None
    handshake_timeout_s: float = 10.0
    read_deadline_s: float = 60.0
    lease_s: float = 120.0
    heartbeat_interval_s: float | None = None
    progress: ProgressPolicy = ProgressPolicy.OFF
    progress_delay_us: int = 100
    num_backend_threads: int | None = None
    split_batch_size: int | None = None
    mode: PlanMode = PlanMode.COALESCED
    prep: PrepStrategy = PrepStrategy.DIRECT
    staging_bytes: int = 256 << 20
    cost: CostParams | None = None
    calibrate: bool = False
    early_completion_grace_s: float = 30.0
    early_completion_limit: int = 4096
    max_pending_handshakes: int = 1024
    pending_handshake_s: float = 60.0
    notifications_per_poll: int = 1024
    notification_backlog_bytes: int = 64 << 20
    secret_file: str | None = None
    side_channel_curve: bool = False
    peer_probe_s: float = 1.0
    max_held_blocks: int | None = None
    post_thread: bool | None = None
    allowed_producers: tuple[str, ...] = DEFAULT_ALLOWED_PRODUCERS
    max_links: int = 256
    max_handshake_sockets: int = 64
    read_batching: str = "per_step"
    read_transport: str = "auto"

    def validate(self) -> EngineConfig:
        """Return self, or raise ConfigError naming the first bad field."""
        if not isinstance(self.side_channel_host, str) or not self.side_channel_host:
            _bad("side_channel_host", self.side_channel_host, "must be a non-empty host name or address")
        if self.side_channel_host.startswith(HOST_SOURCES):
            _bad("side_channel_host", self.side_channel_host,
                 "names where to find the address; only EngineConfig.from_dict resolves it")
        if not isinstance(self.side_channel_port, int) or not 0 <= self.side_channel_port <= 65535:
            _bad("side_channel_port", self.side_channel_port, "must be in [0, 65535] (0 picks a free port)")
        self._validate_advertise_host()
        for name in ("handshake_timeout_s", "read_deadline_s", "lease_s", "heartbeat_interval_s",
                     "early_completion_grace_s", "pending_handshake_s"):
            value = getattr(self, name)
            if name == "heartbeat_interval_s" and value is None:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                _bad(name, value, "must be a positive, finite number of seconds")
        if not isinstance(self.peer_probe_s, (int, float)) or isinstance(self.peer_probe_s, bool) or (
                not math.isfinite(self.peer_probe_s) or self.peer_probe_s < 0):
            _bad("peer_probe_s", self.peer_probe_s, "must be a finite number of seconds >= 0 (0: off)")
        if self.max_held_blocks is not None and (not _is_int(self.max_held_blocks) or self.max_held_blocks < 1):
            _bad("max_held_blocks", self.max_held_blocks, "must be a positive integer or None (90% of the cache)")
        if self.heartbeat_every_s >= self.lease_s:
            _bad("heartbeat_interval_s", self.heartbeat_interval_s, f"must be below lease_s={self.lease_s}")
        if not isinstance(self.early_completion_limit, int) or self.early_completion_limit <= 0:
            _bad("early_completion_limit", self.early_completion_limit, "must be a positive integer")
        if not isinstance(self.progress_delay_us, int) or self.progress_delay_us < 0:
            _bad("progress_delay_us", self.progress_delay_us, "must be a non-negative integer")
        if not _is_int(self.max_pending_handshakes) or self.max_pending_handshakes < 1:
            _bad("max_pending_handshakes", self.max_pending_handshakes, "must be a positive integer")
        if not _is_int(self.notifications_per_poll) or self.notifications_per_poll < 1:
            _bad("notifications_per_poll", self.notifications_per_poll, "must be a positive integer")
        if not _is_int(self.notification_backlog_bytes) or self.notification_backlog_bytes < MAX_MESSAGE_BYTES:
            _bad("notification_backlog_bytes", self.notification_backlog_bytes,
                 f"must be an integer of at least {MAX_MESSAGE_BYTES} (one message of the largest size)")
        if self.secret_file is not None and (not isinstance(self.secret_file, str) or not self.secret_file):
            _bad("secret_file", self.secret_file, "must be a non-empty path or None")
        if self.post_thread is not None and not isinstance(self.post_thread, bool):
            _bad("post_thread", self.post_thread, "must be true, false or None (chosen by the cache's memory)")
        if not isinstance(self.side_channel_curve, bool):
            _bad("side_channel_curve", self.side_channel_curve, "must be true or false")
        AllowedProducers(self.allowed_producers)  # ConfigError naming the bad entry
        for name in ("max_links", "max_handshake_sockets"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _bad(name, getattr(self, name), "must be a positive integer")
        if self.num_backend_threads is not None and (
                not isinstance(self.num_backend_threads, int) or self.num_backend_threads < 0):
            _bad("num_backend_threads", self.num_backend_threads, "must be None or a non-negative integer")
        if self.split_batch_size is not None and (
                not isinstance(self.split_batch_size, int) or self.split_batch_size < 1):
            _bad("split_batch_size", self.split_batch_size, "must be None or a positive integer")
        if self.read_transport not in READ_TRANSPORTS:
            _bad("read_transport", self.read_transport, f"must be one of {list(READ_TRANSPORTS)}")
        if self.read_batching not in READ_BATCHING:
            _bad("read_batching", self.read_batching, f"must be one of {list(READ_BATCHING)}")
        if not isinstance(self.mode, PlanMode):
            _bad("mode", self.mode, f"must be one of {[m.value for m in PlanMode]}")
        if not isinstance(self.staging_bytes, int) or self.staging_bytes < 0 or (
                self.mode in _STAGING_MODES and self.staging_bytes == 0):
            _bad("staging_bytes", self.staging_bytes, "must be a non-negative integer, positive in pack and auto mode")
        if self.cost is not None:
            for name in CostParams.__struct_fields__:
                value = getattr(self.cost, name)
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    _bad(f"cost.{name}", value, "must be a non-negative, finite number of seconds")
        return self

    def uses_post_thread(self, device_memory: bool) -> bool:
        """Whether a consumer over device (True) or host memory posts its READs on a second thread."""
        if self.post_thread is not None:
            return self.post_thread
        return GPU_POST_THREAD if device_memory else HOST_POST_THREAD

    def backend_params(self, device_memory: bool) -> dict[str, str]:
        """The UCX backend's init parameters for a cache in device (True) or host memory."""
        threads, split = GPU_BACKEND_DEFAULTS if device_memory else HOST_BACKEND_DEFAULTS
        threads = threads if self.num_backend_threads is None else self.num_backend_threads
        split = split if self.split_batch_size is None else self.split_batch_size
        params = {"num_threads": str(threads)} if threads > 0 else {}
        if threads > 0 and split is not None:
            params["split_batch_size"] = str(split)
        return params

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, tp_rank: int = 0, tp_size: int | None = None,
                  dp_index: int = 0) -> EngineConfig:
        """Build and validate a config from plain JSON-like values (vLLM's ``kv_connector_extra_config``).

        Keys are this struct's field names; enums are given by value (``"mode": "pack"``), ``cost``
        as a dict of CostParams fields. Only settings live here, never secrets.

        One dict configures every rank of every data-parallel (DP) engine of an endpoint, so two
        values are resolved per rank here (docs/dep.md):

        - ``side_channel_port`` is a base: TP rank ``tp_rank`` of DP engine ``dp_index`` binds
          ``base + dp_index * tp_size + tp_rank`` (``tp_size`` is needed once ``dp_index`` > 0);
          0 lets every rank pick a free port (read it back from ``Producer.rank_card``).
        - ``advertise_host`` and ``side_channel_host`` may name where to find the address instead
          of giving it: ``"env:VAR"`` (this process's environment variable VAR) or
          ``"interface:NAME"`` (the IPv4 address of network interface NAME on this host).

        Raises:
            ConfigError: not a mapping, an unknown key, a value of the wrong type or an invalid
                one, a rank port outside [1, 65535], an unset variable or an unknown interface;
                ``field`` names it.
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"EngineConfig settings must be a mapping, got {type(config).__name__}", field="*",
                              value=type(config).__name__)
        port_offset = rank_port_offset(tp_rank=tp_rank, tp_size=tp_size, dp_index=dp_index)
        for key in config:
            if key not in cls.__struct_fields__:
                raise ConfigError(f"unknown EngineConfig key {key!r}; known: {', '.join(cls.__struct_fields__)}",
                                  field=str(key), value=config[key])
        cost = config.get("cost")
        if isinstance(cost, Mapping):
            for key in cost:
                if key not in CostParams.__struct_fields__:
                    raise ConfigError(f"unknown EngineConfig key 'cost.{key}'; known: "
                                      f"{', '.join(CostParams.__struct_fields__)}", field=f"cost.{key}",
                                      value=cost[key])
        config = dict(config)
        for key in HOST_FIELDS:
            if key in config:
                config[key] = resolve_host_source(config[key], field=key)
        try:
            built = msgspec.convert(config, cls, strict=True)
        except msgspec.ValidationError as exc:
            field = _path_field(str(exc))
            raise ConfigError(f"EngineConfig.{field}={_lookup(config, field)!r}: {exc}", field=field,
                              value=_lookup(config, field)) from exc
        base = built.side_channel_port
        if isinstance(base, int) and base:
            if not 0 < base + port_offset <= 65535:
                raise ConfigError(f"side_channel_port={base} + data_parallel_index {dp_index} x tp_size {tp_size} + "
                                  f"tp_rank {tp_rank} = {base + port_offset} is outside [1, 65535]",
                                  field="side_channel_port", value=base)
            built = msgspec.structs.replace(built, side_channel_port=base + port_offset)
        return built.validate()

    def _validate_advertise_host(self) -> None:
        host = self.advertise_host
        if host is None:
            if self.side_channel_host in WILDCARD_HOSTS:
                _bad("advertise_host", host, f"must be set when side_channel_host={self.side_channel_host!r}: "
                     "a wildcard binds every interface, but no other host can connect to it; advertise an "
                     "address of this host that consumers reach")
            return
        if isinstance(host, str) and host.startswith(HOST_SOURCES):
            _bad("advertise_host", host, "names where to find the address; only EngineConfig.from_dict resolves it")
        if not isinstance(host, str) or not host or host in WILDCARD_HOSTS or any(
                c in host for c in "/ \t\n"):
            _bad("advertise_host", host, "must be a host name or address other hosts can reach (not a wildcard, "
                 "not a URL)")

    def held_blocks_cap(self, num_blocks: int) -> int:
        """The most blocks a producer rank over a cache of ``num_blocks`` blocks keeps pinned (``max_held_blocks``)."""
        if self.max_held_blocks is not None:
            return self.max_held_blocks
        return max(1, int(num_blocks * DEFAULT_HELD_FRACTION))

    @property
    def heartbeat_every_s(self) -> float:
        """The heartbeat interval in effect (``heartbeat_interval_s``, or its default from lease_s)."""
        if self.heartbeat_interval_s is not None:
            return float(self.heartbeat_interval_s)
        return min(5.0, self.lease_s / 4)


HOST_SOURCES = ("env:", "interface:")  # host values that say where the address is (resolved by from_dict)
HOST_FIELDS = ("side_channel_host", "advertise_host")  # the settings that take them
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def rank_port_offset(*, tp_rank: int, tp_size: int | None, dp_index: int) -> int:
    """``dp_index * tp_size + tp_rank``: how far above the base port a rank binds (docs/dep.md).

    Every rank of every DP engine of one endpoint then gets its own port from one base; vLLM's
    own NixlConnector offsets by ``data_parallel_index`` alone (one listener per engine core).

    Raises:
        ConfigError: a negative or non-integer value, ``tp_rank`` not below ``tp_size``, or a DP
            index above 0 without ``tp_size``.
    """
    for name, value in (("tp_rank", tp_rank), ("dp_index", dp_index)):
        if not _is_int(value) or value < 0:
            raise ConfigError(f"{name}={value!r} must be a non-negative integer", field=name, value=value)
    if tp_size is None:
        if dp_index:
            raise ConfigError(f"dp_index={dp_index} needs tp_size (the port offset is dp_index * tp_size + tp_rank)",
                              field="tp_size", value=tp_size)
        return tp_rank
    if not _is_int(tp_size) or tp_size < 1 or tp_rank >= tp_size:
        raise ConfigError(f"tp_size={tp_size!r} must be a positive integer above tp_rank={tp_rank}", field="tp_size",
                          value=tp_size)
    return dp_index * tp_size + tp_rank


def resolve_host_source(value: Any, *, field: str = "advertise_host") -> Any:
    """``"env:VAR"`` -> the variable's value, ``"interface:NAME"`` -> the interface's IPv4 address; else ``value``.

    Raises:
        ConfigError: the variable is unset or empty, or the interface has no IPv4 address here
            (``field`` names the setting).
    """
    if not isinstance(value, str) or not value.startswith(HOST_SOURCES):
        return value
    kind, _, name = value.partition(":")
    if kind == "env":
        host = os.environ.get(name, "").strip() if name else ""
        if not host:
            raise ConfigError(f"EngineConfig.{field}={echo(value)}: environment variable {echo(name)} is unset or "
                              "empty in this process", field=field, value=value)
        return host
    import fcntl  # Linux (as vLLM serving is); imported here so the config module loads everywhere
    import socket
    import struct

    if not 0 < len(name.encode(errors="replace")) < 16 or "\0" in name:  # IFNAMSIZ: the kernel would truncate
        raise ConfigError(f"EngineConfig.{field}={echo(value)}: {echo(name)} is not an interface name (1-15 bytes)",
                          field=field, value=value)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
    except (OSError, UnicodeEncodeError) as exc:
        raise ConfigError(f"EngineConfig.{field}={echo(value)}: interface {echo(name)} has no IPv4 address on this "
                          f"host ({exc})", field=field, value=value) from exc
    return socket.inet_ntoa(packed[20:24])


def _path_field(message: str) -> str:
    """The field a msgspec ValidationError names (``... - at `$.cost.per_byte_s```), dotted."""
    match = re.search(r"at `\$\.([^`]+)`", message)
    return match.group(1) if match else "*"


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(field: str, value: object, why: str) -> None:
    raise ConfigError(f"EngineConfig.{field}={echo(value)} {why}", field=field, value=value)
