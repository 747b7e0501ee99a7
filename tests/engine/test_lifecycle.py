"""Request lifecycles step by step: NIXL replaced by a scripted fake, real handshakes, an injected clock.

The fake lets a READ stay in flight, fail, refuse release, or lose its peer for as long as a test
wants, which real loopback transfers (done inside the post on CPU) never show. Leases, heartbeats,
deadlines, aborts, revocations, quarantine and step fences are all driven by stepping the clock.
"""

from __future__ import annotations

import contextlib

import pytest
from harness import TINY

import hybrid_transfer.engine.consumer as consumer_module
import hybrid_transfer.engine.producer as producer_module
from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, Producer, ReadState, wire
from hybrid_transfer.engine.agent import XferHandle, XferState
from hybrid_transfer.engine.lifecycle.state import FailureCause, HoldState
from hybrid_transfer.errors import (
    BlockBusyError,
    ConfigError,
    EngineError,
    FenceError,
    PeerDisconnectedError,
    ReadDeadlineError,
    RequestAbortedError,
    SourceLostError,
    TicketRevokedError,
)
from hybrid_transfer.layout import RankGeometry, model_from_config

MODEL = model_from_config(TINY, name="tiny")
LAYOUT = ([[0, 1], [2], [3], [4]], 20)
LOCAL = [[5, 6], [7], [8], [9]]
LOCAL_IDS = ((5, 6), (7,), (8,), (9,))
CONFIG = EngineConfig(read_deadline_s=10.0, lease_s=30.0, heartbeat_interval_s=5.0)


class FakeNet:
    """Agents by name; notifications are delivered to the named agent's inbox; ``dead`` agents are gone."""

    def __init__(self):
        self.agents: dict[str, FakeAgent] = {}
        self.dead: set[str] = set()


class FakeAgent:
    net: FakeNet

    def __init__(self, name, config, **_options):  # device_memory: the real agent picks UCX settings by it
        self.name = name
        self.inbox: dict[str, list[bytes]] = {}
        self.sent: list[tuple[str, bytes]] = []
        self.posted: list[XferHandle] = []
        self.outcome = XferState.PROC  # what check() reports for every READ
        self.releasable = True
        self.removed: list[str] = []
        self.net.agents[name] = self

    def register(self, regions):
        self.regions = regions

    @contextlib.contextmanager
    def one_check_per_handle(self):  # the real agent asks NIXL once per handle within; check() here is free
        yield

    @property
    def metadata(self) -> bytes:
        return self.name.encode()

    def add_remote(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote(self, peer: str) -> None:
        self.removed.append(peer)

    def _gone(self, peer, operation):
        return PeerDisconnectedError("NIXL_ERR_REMOTE_DISCONNECT", operation=operation, agent=self.name, peer=peer)

    def post_read(self, peer, local_descs, remote_descs):
        if peer in self.net.dead:
            raise self._gone(peer, "post READ")
        xfer = XferHandle(None, peer, int(local_descs.shape[0]), int(local_descs[:, 1].sum()))
        self.posted.append(xfer)
        return xfer

    def check(self, xfer):
        if xfer.state is XferState.PROC and xfer.peer in self.net.dead:
            xfer.state, xfer.error = XferState.ERR, self._gone(xfer.peer, "check transfer")
        elif xfer.state is XferState.PROC:
            xfer.state = self.outcome
        return xfer.state

    def release(self, xfer):
        if xfer.state is XferState.PROC and not self.releasable:
            return False
        xfer.state = XferState.RELEASED
        return True

    @property
    def num_live_handles(self) -> int:
        return sum(x.state is not XferState.RELEASED for x in self.posted)

    def send_notif(self, peer, message):
        if peer in self.net.dead:
            raise self._gone(peer, "send notification")
        self.sent.append((peer, message))
        self.net.agents[peer].inbox.setdefault(self.name, []).append(message)

    def get_notifs(self):
        out, self.inbox = self.inbox, {}
        return out

    def close(self):
        pass

    def kinds_sent(self, peer=None) -> list[str]:
        return [type(wire.decode(m)[1]).__name__ for p, m in self.sent if peer is None or p == peer]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def net(monkeypatch):
    net = FakeNet()
    monkeypatch.setattr(FakeAgent, "net", net, raising=False)
    monkeypatch.setattr(producer_module, "NixlAgent", FakeAgent)
    monkeypatch.setattr(consumer_module, "NixlAgent", FakeAgent)
    return net


@pytest.fixture
def clock():
    return Clock()


def _consumer(clock, config=CONFIG) -> Consumer:
    return Consumer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), config, clock=clock)


def _link(producer, consumer) -> None:
    """Handshake (real ZeroMQ, wall time), then Hello -> Welcome through the fake."""
    consumer.connect(producer.address, timeout_s=1e9)
    producer.poll()
    consumer.poll()


def _pair(clock, config=CONFIG):
    producer = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), config, clock=clock)
    consumer = _consumer(clock, config)
    _link(producer, consumer)
    assert producer.stats.hellos == 1 and consumer.stats.welcomes == 1
    return producer, consumer


@pytest.fixture
def pair(net, clock):
    producer, consumer = _pair(clock)
    yield producer, consumer, clock
    consumer.close()
    producer.close()


def _completions(agent) -> list[wire.CompletionKind]:
    """Kinds of every completion the consumer sent, single (per_request) or batched per poll (per_step)."""
    kinds = []
    for _, m in agent.sent:
        env, body = wire.decode(m)
        if env.kind is wire.Kind.COMPLETION:
            kinds.append(body.kind)
        elif env.kind is wire.Kind.COMPLETIONS:
            kinds.extend(e.kind for e in body.entries)
    return kinds


# ---- reads, failures and deadlines --------------------------------------------------------
def test_notifications_go_out_only_after_every_read_is_done(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    agent = consumer.agent
    assert len(agent.posted) == 1 and consumer.is_active("r")
    for _ in range(5):
        assert consumer.poll() == [] and producer.poll() == []
    assert _completions(agent) == [] and producer.is_held("r")
    agent.outcome = XferState.DONE
    (result,) = consumer.poll()
    assert result.state is ReadState.DONE and _completions(agent) == [wire.CompletionKind.DONE]
    assert producer.poll() == ["r"] and producer.num_held_blocks == 0
    assert producer.terminal_counts == {"freed": 1} and agent.num_live_handles == 0


def test_a_failed_read_reports_every_group_and_frees_the_producer_early(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    consumer.agent.outcome = XferState.ERR
    (result,) = consumer.poll()
    assert result.state is ReadState.FAILED and result.cause is FailureCause.NIXL
    assert isinstance(result.error, EngineError) and result.local_block_ids == LOCAL_IDS
    assert _completions(consumer.agent) == [wire.CompletionKind.FAILED]
    assert producer.poll() == ["r"] and producer.stats.completions_failed == 1


def test_past_its_deadline_a_read_stays_quarantined_until_no_handle_can_write(pair):
    producer, consumer, clock = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    agent = consumer.agent
    agent.releasable = False  # NIXL refuses to release a READ it cannot cancel
    clock.now += 10.0
    assert consumer.poll() == [] and consumer.is_active("r")
    assert consumer.num_quarantined_blocks == 5 and agent.num_live_handles == 1
    with pytest.raises(BlockBusyError) as info:  # the embedder must not hand these blocks out again
        consumer.start_read(producer.hold("r2", [[10, 11], [12], [13], [14]], 20), LOCAL)
    assert info.value.owners == ("r",) * 5
    assert consumer.poll() == []  # still DRAINING
    agent.releasable = True
    (result,) = consumer.poll()
    assert result.state is ReadState.FAILED and result.cause is FailureCause.DEADLINE
    assert isinstance(result.error, ReadDeadlineError) and result.error.state == "reading"
    assert consumer.num_quarantined_blocks == 0 and agent.num_live_handles == 0


def test_a_read_waiting_for_a_welcome_fails_at_its_deadline(net, clock):
    producer = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), CONFIG, clock=clock)
    consumer = _consumer(clock)
    try:
        consumer.connect(producer.address, timeout_s=1e9)  # the producer never polls: no Welcome
        consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
        clock.now += 9.9
        assert consumer.poll() == [] and consumer.agent.posted == []
        clock.now += 0.1
        (result,) = consumer.poll()
        assert result.cause is FailureCause.DEADLINE and result.error.state == "waiting_peer"
        assert consumer.agent.posted == []
    finally:
        consumer.close()
        producer.close()


def test_zero_tokens_only_notify(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("z", [[], [2], [3], [4]], 0), LOCAL)
    (result,) = consumer.poll()
    assert result.ok and result.num_bytes == 0 and consumer.agent.posted == []
    assert _completions(consumer.agent) == [wire.CompletionKind.DONE] and producer.poll() == ["z"]


def test_a_vanished_source_fails_reads_and_later_tickets_without_posting(pair, net):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    net.dead.add(producer.agent.name)
    (result,) = consumer.poll()
    assert result.state is ReadState.FAILED and result.cause is FailureCause.SOURCE_LOST
    assert isinstance(result.error, SourceLostError) and result.local_block_ids == LOCAL_IDS
    posted = len(consumer.agent.posted)
    consumer.start_read(producer.hold("r2", [[10, 11], [12], [13], [14]], 20), LOCAL)
    (again,) = consumer.poll()
    assert again.cause is FailureCause.SOURCE_LOST and len(consumer.agent.posted) == posted
    assert consumer.num_quarantined_blocks == 0 and consumer.agent.num_live_handles == 0


# ---- leases and heartbeats on the producer's clock -------------------------------------------
def test_a_lease_expires_on_the_producers_clock_and_revokes_the_ticket(pair):
    producer, consumer, clock = pair
    ticket = producer.hold("r", *LAYOUT)
    clock.now += 29.9
    assert producer.poll() == [] and producer.is_held("r")
    clock.now += 0.1
    assert producer.poll() == ["r"] and producer.terminal_counts == {"expired": 1}
    assert producer.num_held_blocks == 0 and producer.stats.revokes_sent == 1
    consumer.poll()  # takes in the Revoke and acknowledges it
    assert consumer.stats.revokes == 1 and "RevokeAck" in consumer.agent.kinds_sent()
    consumer.start_read(ticket, LOCAL)  # a late reader refuses the revoked ticket: nothing is read
    (result,) = consumer.poll()
    assert result.cause is FailureCause.REVOKED and isinstance(result.error, TicketRevokedError)
    assert consumer.agent.posted == []


def test_heartbeats_keep_a_lease_beyond_its_first_expiry(net, clock):
    producer, consumer = _pair(clock, EngineConfig(read_deadline_s=1000.0, lease_s=30.0, heartbeat_interval_s=5.0))
    try:
        consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)  # the READ stays in flight
        for _ in range(20):  # 100 s: more than three leases
            clock.now += 5.0
            assert consumer.poll() == [] and producer.poll() == []
        assert producer.is_held("r") and producer.stats.renewals == 20 and consumer.stats.heartbeats_sent == 20
        # The consumer stops polling (it hung, or died): the lease runs out 30 s after the last renewal.
        clock.now += 29.0
        assert producer.poll() == []
        clock.now += 1.0
        assert producer.poll() == ["r"] and producer.terminal_counts == {"expired": 1}
    finally:
        consumer.close()
        producer.close()


def test_heartbeats_for_unknown_or_ended_requests_are_ignored_and_counted(pair):
    producer, consumer, _ = pair
    producer.hold("r", *LAYOUT)
    refs = (wire.RequestRef("nobody", 1), wire.RequestRef("r", 12345))
    consumer.agent.send_notif(producer.agent.name, wire.encode(wire.Heartbeat(0, refs), consumer._digest))
    producer.poll()
    assert producer.stats.stale_heartbeats == 2 and producer.stats.renewals == 0


# ---- aborts ---------------------------------------------------------------------------------
def test_a_producer_abort_with_no_possible_reader_frees_at_once(net, clock):
    producer = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), CONFIG, clock=clock)
    try:
        producer.hold("r", *LAYOUT)
        assert producer.abort("r") and not producer.abort("r")
        assert producer.poll() == ["r"] and producer.terminal_counts == {"aborted": 1}
        assert producer.num_held_blocks == 0 and producer.stats.revokes_sent == 0
    finally:
        producer.close()


def test_a_producer_abort_waits_for_every_possible_reader_to_acknowledge(pair):
    producer, consumer, _ = pair
    producer.hold("r", *LAYOUT)
    assert producer.abort("r") and producer.hold_state("r") is HoldState.ABORTING
    assert producer.poll() == []  # the consumer has not acknowledged yet
    consumer.poll()
    assert producer.poll() == ["r"] and producer.stats.acks == 1 and producer.terminal_counts == {"aborted": 1}


def test_a_producer_abort_mid_read_never_lets_the_read_end_done(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    producer.abort("r")
    consumer.agent.outcome = XferState.DONE  # the bytes landed, but the revocation came first: not trusted
    results = consumer.poll()
    assert [r.state for r in results] == [ReadState.FAILED] and results[0].cause is FailureCause.REVOKED
    assert _completions(consumer.agent) == [wire.CompletionKind.FAILED]
    assert producer.poll() == ["r"] and producer.terminal_counts == {"aborted": 1}


def test_an_unacknowledged_abort_ends_with_the_lease(pair):
    producer, consumer, clock = pair
    producer.hold("r", *LAYOUT)
    producer.abort("r")
    clock.now += 30.0  # the consumer never polls: no ack
    assert producer.poll() == ["r"] and producer.terminal_counts == {"aborted": 1}


def test_a_late_consumer_learns_revocations_in_its_welcome_before_any_read(pair, clock):
    producer, first, _ = pair
    ticket = producer.hold("r", *LAYOUT)
    producer.abort("r")
    first.poll()
    assert producer.poll() == ["r"]
    late = _consumer(clock)
    try:
        late.connect(producer.address, timeout_s=1e9)
        late.start_read(ticket, LOCAL)  # linked, not yet welcomed: it waits
        assert late.poll() == [] and late.agent.posted == []
        producer.poll()  # the Welcome lists "r"
        (result,) = late.poll()
        assert result.cause is FailureCause.REVOKED and late.agent.posted == []
    finally:
        late.close()


def test_a_consumer_abort_before_reading_frees_the_producer_early(pair):
    producer, consumer, _ = pair
    ticket = producer.hold("r", *LAYOUT)
    other = _consumer(consumer._clock)  # never welcomed: its request waits
    try:
        other.connect(producer.address, timeout_s=1e9)
        other.start_read(ticket, LOCAL)
        assert other.abort("r") and not other.abort("r")
        (result,) = other.poll()
        assert result.state is ReadState.ABORTED and isinstance(result.error, RequestAbortedError)
        assert result.error.state == "waiting_peer" and other.agent.posted == []
        assert producer.poll() == ["r"] and producer.stats.completions_aborted == 1
    finally:
        other.close()


def test_a_consumer_abort_mid_read_quarantines_its_blocks_until_the_handle_is_released(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    consumer.agent.releasable = False
    assert consumer.abort("r")
    assert producer.poll() == ["r"]  # told at once: a READ still in flight only reads
    assert consumer.poll() == [] and consumer.num_quarantined_blocks == 5
    with pytest.raises(BlockBusyError):
        consumer.start_read(producer.hold("r2", [[10, 11], [12], [13], [14]], 20), [[5, 10], [11], [12], [13]])
    consumer.agent.releasable = True
    (result,) = consumer.poll()
    assert result.state is ReadState.ABORTED and result.local_block_ids == LOCAL_IDS
    assert consumer.num_quarantined_blocks == 0 and consumer.terminal_counts["aborted"] == 1


def test_a_closing_consumer_says_bye_and_is_forgotten(pair, clock):
    producer, consumer, _ = pair
    consumer.close()
    producer.poll()
    assert producer.stats.byes == 1 and consumer.agent.name in producer.agent.removed
    producer.hold("r", *LAYOUT)
    producer.abort("r")  # nobody left who could read it
    assert producer.poll() == ["r"]


# ---- step fences ----------------------------------------------------------------------------
def test_a_failed_requests_blocks_wait_for_their_fence_step(pair):
    producer, consumer, _ = pair
    consumer.mark_blocks_written([7, 8], step=5)
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    consumer.agent.outcome = XferState.ERR
    assert consumer.poll() == [] and consumer.num_quarantined_blocks == 5  # handle released, step 5 running
    consumer.finish_step(4)
    assert consumer.poll() == []
    consumer.finish_step(5)
    (result,) = consumer.poll()
    assert result.state is ReadState.FAILED and consumer.num_quarantined_blocks == 0


def test_producer_fences_refuse_early_holds_and_delay_releases(pair):
    producer, consumer, _ = pair
    producer.mark_blocks_written([1, 4], step=3)
    with pytest.raises(FenceError) as info:
        producer.hold("r", *LAYOUT)
    assert info.value.block_ids == (1, 4) and not producer.is_held("r")
    producer.finish_step(3)
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    producer.mark_blocks_written([2], step=7)  # a step queued later still writes block 2
    consumer.agent.outcome = XferState.DONE
    assert producer.poll() == []  # confirms the consumer's claim (engine/claims.py)
    assert consumer.poll()[0].ok
    assert producer.poll() == [] and producer.num_held_blocks == 5 and producer.terminal_counts == {"freed": 1}
    producer.finish_step(7)
    assert producer.poll() == ["r"] and producer.num_held_blocks == 0


def test_steps_must_be_non_negative_integers(pair):
    producer, consumer, _ = pair
    for engine in (producer, consumer):
        with pytest.raises(ConfigError):
            engine.mark_blocks_written([1], -1)
        with pytest.raises(ConfigError):
            engine.finish_step(1.5)


def test_heartbeat_interval_must_be_below_the_lease():
    with pytest.raises(ConfigError) as info:
        EngineConfig(lease_s=4.0, heartbeat_interval_s=4.0).validate()
    assert info.value.field == "heartbeat_interval_s"
    assert EngineConfig(lease_s=4.0).validate().heartbeat_every_s == 1.0
