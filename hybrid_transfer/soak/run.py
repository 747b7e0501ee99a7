"""The soak's coordinator: a prefill and a decode process on loopback, thousands of requests, faults mixed in.

Per batch: the producer fills and holds every request (random token counts, blocks drawn at random
from the free pool: random fragmentation); the consumer reads them. About ``abort_rate`` of the
requests are aborted by the producer's embedder and as many by the consumer's, after a random number
of polls. ``stall_rate`` of the tickets reach the consumer only after their lease expired (it must
then fail them). Replayed tickets (already read and freed, their blocks re-held since), edited ones
and forged notifications are mixed in; a stranger with the wrong secret tries to handshake. Once the
producer process and once the consumer process are killed with SIGKILL while reads are in flight
and started again; the survivor handshakes with the new incarnation.

Each request must end exactly once on each side (or go down with a killed process), every DONE
request must hold the oracle's bytes, no attack may end DONE, and at the end nothing may be pinned,
quarantined or alive in NIXL. See docs/soak.md.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import random
import secrets
import signal
import time
import uuid
from collections import Counter
from typing import TypeVar

import msgspec

from hybrid_transfer.engine.config import READ_TRANSPORTS
from hybrid_transfer.engine.metrics import ConsumerMetrics, ProducerMetrics
from hybrid_transfer.errors import BenchError, ConfigError
from hybrid_transfer.plan.validate import expected_bytes
from hybrid_transfer.soak import messages as m
from hybrid_transfer.soak.worker import geometry_of, worker_main

log = logging.getLogger(__name__)
R = TypeVar("R")
SECRET_ENV = "HYBRID_TRANSFER_SECRET"  # engine/auth.py reads it in every rank process
ABORT_MOMENTS = (-1, 0, 0, 1, 2, 3, 5, 8, 13)  # polls after hold / start_read; -1: at once


class SoakSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One soak run."""

    requests: int = 10_000
    batch: int = 200
    model: str = "tiny"
    max_tokens: int = 64
    num_blocks: int = 8192
    abort_rate: float = 0.10  # per side
    stall_rate: float = 0.03  # tickets that reach the consumer after their lease expired
    replay_rate: float = 0.02  # extra reads of old tickets
    edit_rate: float = 0.01  # reads of edited tickets instead of the real one
    forge_every: int = 5  # batches between rounds of forged notifications (and a stranger's handshake)
    rival: bool = True  # forge rounds: a second consumer declines, aborts or reads the live tickets (soak/rival.py)
    hostile_params: int = 4  # forge rounds: hostile kv_transfer_params per live ticket (soak/hostile.py)
    kills: bool = True  # SIGKILL and restart the producer and the consumer once each
    auth: bool = True
    lease_s: float = 10.0  # long enough for a batch to be held and read on a busy host; stalls wait it out
    heartbeat_s: float = 0.5
    read_deadline_s: float = 10.0
    # How the consumer reads (EngineConfig.read_transport): "auto" and "mapped" put the producer's cache in shared
    # memory, so the consumer maps it and every READ is a copy over the mapping; "nixl" reads over NIXL.
    read_transport: str = "auto"
    seed: int = 20261130
    log_level: str = "WARNING"

    def validate(self) -> SoakSpec:
        def bad(name, why):
            raise ConfigError(f"soak {name}={getattr(self, name)!r} {why}", field=name, value=getattr(self, name))
        if not 1 <= self.requests <= 10_000_000:
            bad("requests", "must be in [1, 10000000]")
        if not 1 <= self.batch <= 10_000:
            bad("batch", "must be in [1, 10000]")
        if not 0 <= self.max_tokens <= 100_000:
            bad("max_tokens", "must be in [0, 100000]")
        for name in ("abort_rate", "stall_rate", "replay_rate", "edit_rate"):
            if not 0.0 <= getattr(self, name) <= 0.3:
                bad(name, "must be in [0, 0.3]")
        if not 0 <= self.hostile_params <= 64:
            bad("hostile_params", "must be in [0, 64]")
        if self.read_transport not in READ_TRANSPORTS:
            bad("read_transport", f"must be one of {list(READ_TRANSPORTS)}")
        if not 0 < self.heartbeat_s < self.lease_s:
            bad("heartbeat_s", "must be positive and shorter than the lease")
        geometry = geometry_of(self.model)
        need = math.ceil(self.max_tokens / geometry.block_size) + 3 + 1
        if self.num_blocks < 3 * need * self.batch:  # a batch, and what earlier ones carry over (stalls, replays)
            bad("num_blocks", f"must be at least {3 * need * self.batch} for batches of {self.batch} "
                f"with up to {self.max_tokens} tokens")
        return self


class SoakReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    requests: int
    completed: int  # DONE and verified against the oracle
    failed_by_cause: dict[str, int]  # consumer FAILED, by cause
    aborted: int  # consumer ABORTED
    refused_at_start: dict[str, int]  # start_read raised, by exception type
    lost_with_consumer: int  # in flight when the consumer process was killed
    lost_with_producer: int  # held when the producer process was killed
    producer_released: int
    producer_ended: dict[str, int]  # summed over producer incarnations that finished: freed / expired / aborted
    unfinished: int  # requests without a terminal state on some side (must be 0)
    reported_twice: int  # must be 0
    wrong_bytes: int  # DONE requests whose blocks differ from the oracle (must be 0)
    bytes_verified: int
    byte_mismatches: int  # consumer metrics: READs whose bytes disagreed with the layout (must be 0)
    attacks: dict[str, dict[str, int]]  # replay / edit reads by outcome; any DONE is wrong
    attacks_done: list[str]  # keys of replayed or edited reads that ended DONE (must be empty)
    forged_sent: int
    rejected_messages: dict[str, int]  # producer, by cause (final incarnation)
    rejected_peers: int  # producer handshakes refused (final incarnation)
    malformed: int  # producer: notifications that were not ours (the forged garbage; final incarnation)
    stranger_refusals: dict[str, int]  # exception the wrong-secret stranger's handshake raised
    rival: dict[str, int]  # second consumer and hostile params: action/outcome -> count (docs/soak.md#rival)
    rival_state: dict[str, int]  # second consumer's final state (last decode incarnation)
    kills: list[str]
    blocks_pinned: int
    quarantined: int
    handles_leaked: int
    rss_growth_kib: dict[str, int]  # per final process, from after its engine started
    post_to_done_ms: dict[str, float]  # final consumer incarnation: count, mean, p50, p99 bucket bounds, max
    leases_expired: int
    reclaims: int
    elapsed_s: float
    auth: bool
    checks: dict[str, bool]
    read_transport: str = "auto"  # the spec's
    reads_by_transport: dict[str, int] = {}  # final consumer incarnation: READs posted over NIXL, over a mapping

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


class _Proc:
    """One spawned rank process and its command pipe."""

    def __init__(self, ctx, name: str, log_level: str):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, log_level), name=f"hybrid-transfer-soak-{name}",
                                   daemon=True)
        self.process.start()
        child.close()

    def send(self, cmd) -> None:
        self.conn.send_bytes(m.encode(cmd))

    def recv(self, expected: type[R], timeout_s: float = 300.0) -> R:
        if not self.conn.poll(timeout_s):
            raise BenchError(f"no answer within {timeout_s} s", where=self.name)
        try:
            return m.decode_reply(self.conn.recv_bytes(), expected)
        except EOFError as exc:
            raise BenchError("the process died", where=self.name) from exc

    def call(self, cmd, expected: type[R], timeout_s: float = 300.0) -> R:
        self.send(cmd)
        return self.recv(expected, timeout_s)

    def kill9(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.send(m.Stop())
            except (BrokenPipeError, OSError):
                pass
            self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class _Pool:
    """Free block ids of one side; requests draw at random (fragmentation) and give back when they end."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = set(range(num_blocks))

    def take(self, rng: random.Random, n: int) -> list[int]:
        ids = rng.sample(sorted(self.free), n)
        self.free.difference_update(ids)
        return ids

    def give(self, block_ids) -> None:
        for group in block_ids:
            self.free.update(group)

    def reset(self) -> None:
        self.free = set(range(self.num_blocks))


def _layout(pool: _Pool, rng: random.Random, num_tokens: int, block_size: int, extra: int):
    need = math.ceil(num_tokens / block_size) + extra
    ids = pool.take(rng, need + 3)
    return (tuple(ids[:need]), (ids[need],), (ids[need + 1],), (ids[need + 2],))


class Soak:
    def __init__(self, spec: SoakSpec, progress=None):
        self.spec = spec.validate()
        self.geometry = geometry_of(spec.model)
        if len(self.geometry.tensor_map.groups) != 4:
            raise ConfigError(f"soak model {spec.model!r}: only models with one attention and three GDN cache "
                              "groups are supported", field="model", value=spec.model)
        self.rng = random.Random(spec.seed)
        self.ctx = mp.get_context("spawn")
        self.progress = progress or (lambda line: None)
        self.p_pool, self.c_pool = _Pool(spec.num_blocks), _Pool(spec.num_blocks)
        self.consumer_outcome: dict[str, m.Outcome | str] = {}
        self.producer_outcome: dict[str, m.Outcome | str] = {}
        self.attack_outcomes: dict[str, Counter] = {"replay": Counter(), "edit": Counter()}
        self.wrong_bytes = 0
        self.attacks_done: list[str] = []
        self.bytes_verified = 0
        self.reported_twice = 0
        self.forged_sent = 0
        self.stranger: Counter = Counter()
        self.rival: Counter = Counter()
        self.kills: list[str] = []
        self.replayable: list[str] = []  # requests read DONE and released: their tickets are replay material
        self.layouts: dict[str, tuple] = {}  # request id -> (remote block ids, local block ids, tokens, seed)
        self.tickets: dict[str, bytes] = {}
        self.edit_keys: set[str] = set()
        self.replay_blocks: dict[str, tuple] = {}  # replay key -> its local block ids
        self.stalled: list[str] = []  # held, never read: waiting for the producer to release them (lease)
        self.pending_c: set[str] = set()  # reads carried over to later batches (late reads, replays)
        self.ended_totals: Counter = Counter()
        self.producer: _Proc | None = None
        self.consumer: _Proc | None = None

    # ---- processes ----------------------------------------------------------------------------
    def _setup(self, prefill: bool) -> tuple[_Proc, m.Ready]:
        s = self.spec
        name = "prefill" if prefill else "decode"
        proc = _Proc(self.ctx, name, s.log_level)
        ready = proc.call(m.Setup(prefill=prefill, model=s.model, num_blocks=s.num_blocks,
                                  engine_id=f"soak-{name}-{uuid.uuid4().hex[:6]}",
                                  incarnation=secrets.randbits(62), lease_s=s.lease_s, heartbeat_s=s.heartbeat_s,
                                  read_deadline_s=s.read_deadline_s, log_level=s.log_level,
                                  read_transport=s.read_transport), m.Ready, 120.0)
        return proc, ready

    def _start_producer(self) -> None:
        self.producer, self.p_ready = self._setup(True)
        self.p_pool.reset()
        self.replayable.clear()  # tickets of an earlier incarnation name an address nobody listens at

    def _start_consumer(self) -> None:
        self.consumer, self.c_ready = self._setup(False)
        self.c_pool.reset()

    def _connect(self) -> None:
        self.consumer.call(m.Connect(self.p_ready.address), m.Done, 60.0)

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> SoakReport:
        s = self.spec
        started = time.monotonic()
        old_secret = os.environ.get(SECRET_ENV)
        if s.auth:
            os.environ[SECRET_ENV] = old_secret or secrets.token_hex(32)  # spawned ranks inherit it
        else:
            os.environ.pop(SECRET_ENV, None)
        try:
            self._start_producer()
            self._start_consumer()
            self._connect()
            batches = math.ceil(s.requests / s.batch)
            kill_p = batches // 3 if s.kills else -1
            kill_c = (2 * batches) // 3 if s.kills else -1
            if s.kills and batches < 3:
                raise ConfigError("soak with kills needs at least 3 batches", field="requests", value=s.requests)
            for b in range(batches):
                n = min(s.batch, s.requests - b * s.batch)
                kill = "producer" if b == kill_p else "consumer" if b == kill_c else None
                self._batch(b, n, kill)
                if b % 10 == 0 or kill:
                    done = sum(1 for o in self.consumer_outcome.values() if _done(o))
                    self.progress(f"batch {b + 1}/{batches}: {done} done so far")
            self._drain()
            p_final = self.producer.call(m.Final(1.0), m.FinalState, 120.0)
            c_final = self.consumer.call(m.Final(1.0), m.FinalState, 120.0)
            return self._report(p_final, c_final, time.monotonic() - started)
        finally:
            for proc in (self.consumer, self.producer):
                if proc is not None:
                    proc.close()
            if old_secret is None:
                os.environ.pop(SECRET_ENV, None)
            else:
                os.environ[SECRET_ENV] = old_secret

    def _batch(self, b: int, n: int, kill: str | None) -> None:
        s, rng, bs = self.spec, self.rng, self.geometry.block_size
        if kill:
            self._drain()  # nothing carried over into a kill: what it loses is this batch's
        holds, reads, stalled = [], [], []
        for i in range(n):
            rid = f"b{b}-r{i}-{uuid.uuid4().hex[:4]}"
            tokens = rng.randint(0, s.max_tokens)
            fate = rng.random()
            p_abort = rng.choice(ABORT_MOMENTS) if fate < s.abort_rate else None
            c_abort = rng.choice(ABORT_MOMENTS) if s.abort_rate <= fate < 2 * s.abort_rate else None
            stall = 2 * s.abort_rate <= fate < 2 * s.abort_rate + s.stall_rate
            # Edited and replayed tickets have tokens: a ticket of none is DONE without a READ or a claim.
            edit = tokens > 0 and 2 * s.abort_rate + s.stall_rate <= fate < 2 * s.abort_rate + s.stall_rate + s.edit_rate
            remote = _layout(self.p_pool, rng, tokens, bs, 0)
            local = _layout(self.c_pool, rng, tokens, bs, rng.choice((0, 0, 1)))
            seed = rng.randrange(1 << 40)
            self.layouts[rid] = (remote, local, tokens, seed)
            holds.append(m.HoldItem(rid, remote, tokens, seed, p_abort))
            if stall:
                stalled.append(rid)
            else:
                reads.append((rid, c_abort, edit))
                if edit:
                    self.edit_keys.add(rid)
        tickets = self.producer.call(m.Hold(tuple(holds)), m.Tickets).tickets
        self.tickets.update(zip([h.request_id for h in holds], tickets, strict=True))
        items = [self._read_item(rid, c_abort, edit) for rid, c_abort, edit in reads]
        self.consumer.call(m.Read(tuple(items)), m.Done)
        if kill == "producer":
            time.sleep(rng.uniform(0.0, 0.05))
            self._kill_producer(holds, items, stalled)
            return
        if kill == "consumer":
            time.sleep(rng.uniform(0.0, 0.05))
            self._kill_consumer(holds, items, stalled)
            return
        if s.forge_every and b % s.forge_every == s.forge_every - 1:
            self._forge([(rid, _ticket_nonce(self.tickets[rid])) for rid, *_ in reads[:8]],
                        [rid for rid, *_ in reads[8:16]])
        self._take_consumer([it.key for it in items], self._wait_s)
        num_replays = sum(rng.random() < s.replay_rate for _ in range(n))
        self._replay_fresh([rid for rid, _, edit in reads if not edit], num_replays)
        self._take_producer([h.request_id for h in holds if h.request_id not in stalled], self._wait_s)
        self.stalled.extend(stalled)
        # Carried over, collected by later batches without waiting: stalled tickets reach the consumer once
        # their lease expired and the producer freed them; tickets read DONE in earlier batches, freed since
        # and their blocks re-held, are replayed.
        self._late_reads(0.0)
        replays = []
        for _ in range(min(num_replays, len(self.replayable))):
            rid = self.replayable.pop(rng.randrange(len(self.replayable)))
            key = f"replay:{rid}"
            self.replay_blocks[key] = _layout(self.c_pool, rng, s.max_tokens, bs, 0)
            replays.append(m.ReadItem(key, self.tickets[rid], self.replay_blocks[key], self.layouts[rid][2], 0, None))
        if replays:
            self.consumer.call(m.Read(tuple(replays)), m.Done)
            self.pending_c.update(it.key for it in replays)
        self._take_consumer(sorted(self.pending_c), 0.0)
        for rid, _, edit in reads:
            if not edit and self.layouts[rid][2] > 0 and _done(self.consumer_outcome.get(rid)):
                self.replayable.append(rid)
        del self.replayable[:-2000]

    @property
    def _wait_s(self) -> float:
        return self.spec.read_deadline_s + 3 * self.spec.lease_s + 30.0

    def _read_item(self, rid: str, c_abort: int | None = None, edit: bool = False) -> m.ReadItem:
        _, local, tokens, seed = self.layouts[rid]
        return m.ReadItem(rid, self.tickets[rid], local, tokens, seed, c_abort, edit)

    def _late_reads(self, timeout_s: float) -> None:
        """Stalled requests the producer released (lease expired): only now the consumer gets their tickets."""
        if not self.stalled:
            return
        released = self._take_producer(self.stalled, timeout_s)
        self.stalled = [rid for rid in self.stalled if rid not in released]
        if released:
            self.consumer.call(m.Read(tuple(self._read_item(rid) for rid in released)), m.Done)
            self.pending_c.update(released)

    def _drain(self) -> None:
        """Wait for everything carried over: stalled holds to expire, their late reads and the replays to end."""
        self._late_reads(self._wait_s + 3 * self.spec.lease_s)
        self._take_consumer(sorted(self.pending_c), self._wait_s)

    def _replay_fresh(self, rids, count: int) -> None:
        """Replay tickets of this batch read DONE a moment ago, while their producer still remembers them."""
        s, rng = self.spec, self.rng
        done_here = [rid for rid in rids if self.layouts[rid][2] > 0 and _done(self.consumer_outcome.get(rid))]
        items = []
        for rid in rng.sample(done_here, min(len(done_here), count)):
            key = f"replay:{rid}:fresh"
            self.replay_blocks[key] = _layout(self.c_pool, rng, s.max_tokens, self.geometry.block_size, 0)
            items.append(m.ReadItem(key, self.tickets[rid], self.replay_blocks[key], self.layouts[rid][2], 0, None))
        if items:
            self.consumer.call(m.Read(tuple(items)), m.Done)
            self._take_consumer([it.key for it in items], self._wait_s)

    def _take_consumer(self, keys, timeout_s) -> None:
        if not keys:
            return
        got = self.consumer.call(m.Wait(tuple(keys), timeout_s), m.Outcomes, timeout_s + 120).outcomes
        for key, o in got.items():
            self.pending_c.discard(key)
            self._consumer_ended(key, o)

    def _consumer_ended(self, key, o: m.Outcome) -> None:
        if o.times != 1:
            self.reported_twice += 1
        if key in self.replay_blocks:
            self.c_pool.give(self.replay_blocks.pop(key))
            self.attack_outcomes["replay"][_label(o)] += 1
            self._attack_ended(key, o)
            return
        _, local, tokens, _ = self.layouts[key]
        self.c_pool.give(local)
        if key in self.edit_keys:
            self.attack_outcomes["edit"][_label(o)] += 1
            self._attack_ended(key, o)
        elif o.state == "done":
            if o.verified:
                self.bytes_verified += expected_bytes(self.geometry, tokens)
            else:
                self.wrong_bytes += 1
        self._once(self.consumer_outcome, key, o)

    def _attack_ended(self, key: str, o: m.Outcome) -> None:
        if o.state == "done":  # a replayed or edited ticket must never be DONE
            self.wrong_bytes += 1
            self.attacks_done.append(key)

    def _take_producer(self, rids, timeout_s) -> list[str]:
        got = self.producer.call(m.Wait(tuple(rids), timeout_s), m.Outcomes, timeout_s + 120).outcomes
        for rid, o in got.items():
            if o.times != 1:
                self.reported_twice += 1
            self.p_pool.give(self.layouts[rid][0])
            self._once(self.producer_outcome, rid, o)
        return [rid for rid in rids if rid in got]

    def _once(self, table, key, value) -> None:
        if key in table:
            self.reported_twice += 1
        table[key] = value

    def _forge(self, refs, rival_rids) -> None:
        s = self.spec
        if not s.auth:
            refs = []  # without a secret a Completion from a handshaked agent is indistinguishable from its own
        if not s.rival:
            rival_rids = []
        tickets = tuple(self.tickets[rid] for rid in rival_rids)
        seeds = tuple(self.layouts[rid][3] for rid in rival_rids)
        forge = m.Forge(self.p_ready.agent_name, self.p_ready.address, tuple(refs), tickets=tickets, seeds=seeds,
                        hostile=s.hostile_params, seed=self.rng.randrange(1 << 32))
        forged = self.consumer.call(forge, m.Forged, 120.0)
        self.forged_sent += forged.sent
        self.stranger[forged.stranger_error or "ACCEPTED"] += 1
        self.rival.update(forged.rival)

    def _kill_producer(self, holds, items, stalled) -> None:
        """SIGKILL the producer while reads are in flight; the consumer must fail (or finish) each, then relink."""
        self.producer.kill9()
        self.kills.append(f"producer (pid {self.p_ready.pid}) with {len(items)} reads just posted")
        for h in holds:
            self._once(self.producer_outcome, h.request_id, "lost")
        for rid in stalled:  # never handed over: the embedder drops them with the producer
            self._once(self.consumer_outcome, rid, "lost")
            self.c_pool.give(self.layouts[rid][1])
        self._take_consumer([it.key for it in items], self._wait_s)
        self._start_producer()
        self._connect()

    def _kill_consumer(self, holds, items, stalled) -> None:
        """SIGKILL the consumer with reads in flight; the producer must free every hold (reclaim or lease)."""
        self.consumer.kill9()
        self.kills.append(f"consumer (pid {self.c_ready.pid}) with {len(items)} reads just posted")
        for key in [it.key for it in items] + stalled:
            self._once(self.consumer_outcome, key, "lost")
        self._take_producer([h.request_id for h in holds], self._wait_s + 3 * self.spec.lease_s)
        self._start_consumer()
        self._connect()

    # ---- the report -----------------------------------------------------------------------------
    def _report(self, p_final: m.FinalState, c_final: m.FinalState, elapsed_s: float) -> SoakReport:
        s = self.spec
        cm = msgspec.msgpack.decode(c_final.metrics, type=ConsumerMetrics)
        pm = msgspec.msgpack.decode(p_final.metrics, type=ProducerMetrics)
        outcomes = [o for o in self.consumer_outcome.values() if isinstance(o, m.Outcome)]
        failed = Counter(o.cause or "?" for o in outcomes if o.state == "failed")
        raised = Counter(o.cause or "?" for o in outcomes if o.state == "raised")
        all_rids = set(self.producer_outcome) | set(self.consumer_outcome)
        unfinished = (s.requests - len(all_rids)) + sum(
            1 for rid in all_rids if rid not in self.producer_outcome or rid not in self.consumer_outcome)
        lat = cm.post_to_done
        self.rival.update(c_final.rival)
        rs = c_final.rival_state
        checks = {
            "every request ended exactly once on each side": unfinished == 0 and self.reported_twice == 0,
            "zero wrong bytes": self.wrong_bytes == 0 and cm.byte_mismatches == 0,
            "zero blocks pinned": p_final.pinned_blocks == 0 and p_final.held_requests == 0,
            "zero blocks quarantined": c_final.quarantined_blocks == 0 and c_final.active == 0,
            "zero handles leaked": p_final.live_handles == 0 and c_final.live_handles == 0,
            "stranger handshakes refused": "ACCEPTED" not in self.stranger,
        }
        if s.rival and self.rival:
            checks["second consumer: right bytes, ended empty"] = (
                rs.get("wrong_bytes", 0) == 0 and not any("/WRONG" in k for k in self.rival)
                and rs.get("active", 0) == 0 and rs.get("quarantined", 0) == 0 and rs.get("handles", 0) == 0)
            checks["hostile params: typed refusals, none DONE"] = (
                not any("/UNTYPED:" in k for k in self.rival) and rs.get("hostile_done", 0) == 0
                and not any(k.startswith("params:") and "/done" in k for k in self.rival))
        if s.kills:
            checks["one kill and restart of each side"] = len(self.kills) == 2
        mapped_reads = sum(n for kind, n in cm.reads_by_transport.items() if kind != "nixl")
        if s.read_transport == "nixl":
            checks["every READ over NIXL"] = mapped_reads == 0
        elif cm.reads_by_transport:  # a consumer incarnation that read nothing (killed early) has no figures
            checks["READs over the mapping (shared memory)"] = mapped_reads > 0
        return SoakReport(
            requests=s.requests,
            completed=sum(1 for o in outcomes if o.state == "done" and o.verified),
            failed_by_cause=dict(sorted(failed.items())), aborted=sum(o.state == "aborted" for o in outcomes),
            refused_at_start=dict(sorted(raised.items())),
            lost_with_consumer=sum(1 for o in self.consumer_outcome.values() if o == "lost"),
            lost_with_producer=sum(1 for o in self.producer_outcome.values() if o == "lost"),
            producer_released=sum(1 for o in self.producer_outcome.values() if isinstance(o, m.Outcome)),
            producer_ended=dict(sorted(p_final.terminal.items())), unfinished=unfinished,
            reported_twice=self.reported_twice, wrong_bytes=self.wrong_bytes, bytes_verified=self.bytes_verified,
            byte_mismatches=cm.byte_mismatches,
            attacks={k: dict(sorted(v.items())) for k, v in self.attack_outcomes.items()},
            attacks_done=self.attacks_done[:20],
            forged_sent=self.forged_sent, rejected_messages=dict(sorted(pm.rejected_messages.items())),
            rejected_peers=pm.rejected_peers, malformed=pm.malformed, stranger_refusals=dict(self.stranger),
            rival=dict(sorted(self.rival.items())), rival_state=dict(rs), kills=self.kills,
            blocks_pinned=p_final.pinned_blocks, quarantined=c_final.quarantined_blocks,
            handles_leaked=p_final.live_handles + c_final.live_handles,
            rss_growth_kib={"prefill": p_final.rss_kib - p_final.rss_start_kib,
                            "decode": c_final.rss_kib - c_final.rss_start_kib},
            post_to_done_ms={"count": lat.count, "mean": round(lat.mean_s * 1e3, 3),
                             "p50_bucket": round(lat.quantile(0.5) * 1e3, 3),
                             "p99_bucket": round(lat.quantile(0.99) * 1e3, 3),
                             "max": round(lat.max_s * 1e3, 3)},
            leases_expired=pm.leases_expired, reclaims=pm.reclaims, elapsed_s=round(elapsed_s, 1), auth=s.auth,
            checks=checks, read_transport=s.read_transport, reads_by_transport=dict(sorted(cm.reads_by_transport.items())))


def _label(o: m.Outcome) -> str:
    return f"{o.state}/{o.cause}" if o.cause else o.state


def _done(o) -> bool:
    return isinstance(o, m.Outcome) and o.state == "done"


def _ticket_nonce(ticket: bytes) -> int:
    from hybrid_transfer.engine import decode_ticket

    return decode_ticket(ticket).nonce


def render(report: SoakReport) -> str:
    """The report as the lines `hybrid-transfer soak` prints."""
    r = report
    lines = [
        f"soak: {r.requests} requests in {r.elapsed_s} s, authentication {'on' if r.auth else 'OFF'}, "
        f"read transport {r.read_transport}",
        f"  completed (DONE, bytes verified): {r.completed}",
        f"  failed by cause:                  {r.failed_by_cause}",
        f"  aborted:                          {r.aborted}",
        f"  refused at start_read:            {r.refused_at_start}",
        f"  lost with a killed process:       consumer {r.lost_with_consumer}, producer {r.lost_with_producer}",
        f"  producer released:                {r.producer_released}; last incarnation ended {r.producer_ended}",
        f"  leases expired / reclaims:        {r.leases_expired} / {r.reclaims} (last producer incarnation)",
        f"  bytes verified:                   {r.bytes_verified}",
        f"  wrong bytes (requests):           {r.wrong_bytes}; byte-count mismatches {r.byte_mismatches}",
        f"  attacks (replayed / edited):      {r.attacks}" + (f"; DONE: {r.attacks_done}" if r.attacks_done else ""),
        f"  forged notifications sent:        {r.forged_sent}; producer rejected {r.rejected_messages}, "
        f"malformed {r.malformed}",
        f"  stranger handshakes:              {r.stranger_refusals}; producer rejected peers {r.rejected_peers}",
        f"  second consumer / hostile params: {r.rival}",
        f"  second consumer at the end:       {r.rival_state}",
        f"  kills:                            {r.kills}",
        f"  blocks pinned:                    {r.blocks_pinned}",
        f"  quarantined:                      {r.quarantined}",
        f"  handles leaked:                   {r.handles_leaked}",
        f"  RSS growth (KiB):                 {r.rss_growth_kib}",
        f"  post-to-DONE (ms):                {r.post_to_done_ms}",
        f"  READs by transport:               {r.reads_by_transport} (last consumer incarnation)",
        f"  unfinished / reported twice:      {r.unfinished} / {r.reported_twice}",
        "checks:",
    ]
    lines += [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in r.checks.items()]
    lines.append("soak: PASS" if r.ok else "soak: FAIL")
    return "\n".join(lines)


def run_soak(spec: SoakSpec, progress=None) -> SoakReport:
    return Soak(spec, progress).run()
