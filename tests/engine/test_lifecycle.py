"""Request lifecycles step by step: NIXL replaced by a scripted fake, real handshakes, an injected clock.

The fake lets a READ stay in flight, fail, or refuse release for as long as a test wants, which
real loopback transfers (done inside the post on CPU) never show.
"""

from __future__ import annotations

import pytest
from harness import TINY

import hybrid_transfer.engine.consumer as consumer_module
import hybrid_transfer.engine.producer as producer_module
from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, Producer, ReadState
from hybrid_transfer.engine.agent import XferHandle
from hybrid_transfer.engine.state import XferState
from hybrid_transfer.errors import EngineError, ReadDeadlineError
from hybrid_transfer.layout import RankGeometry, model_from_config

MODEL = model_from_config(TINY, name="tiny")
LAYOUT = ([[0, 1], [2], [3], [4]], 20)
LOCAL = [[5, 6], [7], [8], [9]]


class FakeNet:
    """Agents by name; notifications are delivered to the named agent's inbox."""

    def __init__(self):
        self.agents: dict[str, FakeAgent] = {}


class FakeAgent:
    net: FakeNet

    def __init__(self, name, config):
        self.name = name
        self.inbox: dict[str, list[bytes]] = {}
        self.sent: list[tuple[str, bytes]] = []
        self.posted: list[XferHandle] = []
        self.outcome = XferState.PROC  # what check() reports for every READ
        self.releasable = True
        self.net.agents[name] = self

    def register(self, regions):
        self.regions = regions

    @property
    def metadata(self) -> bytes:
        return self.name.encode()

    def add_remote(self, metadata: bytes) -> str:
        return metadata.decode()

    def post_read(self, peer, local_descs, remote_descs):
        xfer = XferHandle(None, peer, int(local_descs.shape[0]), int(local_descs[:, 1].sum()))
        self.posted.append(xfer)
        return xfer

    def check(self, xfer):
        if xfer.state is XferState.PROC:
            xfer.state = self.outcome
        return xfer.state

    def release(self, xfer):
        if xfer.state is XferState.PROC and not self.releasable:
            return False
        xfer.state = XferState.RELEASED
        return True

    def send_notif(self, peer, message):
        self.sent.append((peer, message))
        self.net.agents[peer].inbox.setdefault(self.name, []).append(message)

    def get_notifs(self):
        out, self.inbox = self.inbox, {}
        return out

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def pair(monkeypatch):
    net = FakeNet()
    monkeypatch.setattr(FakeAgent, "net", net, raising=False)
    monkeypatch.setattr(producer_module, "NixlAgent", FakeAgent)
    monkeypatch.setattr(consumer_module, "NixlAgent", FakeAgent)
    clock = Clock()
    config = EngineConfig(read_deadline_s=10.0)
    producer = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), config, clock=clock)
    consumer = Consumer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), config, clock=clock)
    consumer.connect(producer.address, timeout_s=1e9)  # real ZeroMQ handshake, wall time
    yield producer, consumer, clock
    consumer.close()
    producer.close()


def test_notifications_go_out_only_after_every_read_is_done(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    agent = consumer.agent
    assert len(agent.posted) == 1 and consumer.is_active("r")
    for _ in range(5):
        assert consumer.poll() == [] and producer.poll() == []
    assert agent.sent == [] and producer.is_held("r")
    agent.outcome = XferState.DONE
    (result,) = consumer.poll()
    assert result.state is ReadState.DONE and len(agent.sent) == 1
    assert producer.poll() == ["r"] and producer.num_held_blocks == 0
    assert all(x.state is XferState.RELEASED for x in agent.posted)


def test_a_failed_read_reports_every_group_and_notifies_nobody(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    consumer.agent.outcome = XferState.ERR
    (result,) = consumer.poll()
    assert result.state is ReadState.FAILED and isinstance(result.error, EngineError)
    assert result.local_block_ids == ((5, 6), (7,), (8,), (9,))
    assert consumer.agent.sent == [] and producer.poll() == [] and producer.is_held("r")


def test_past_its_deadline_a_read_drains_until_no_handle_can_write(pair):
    producer, consumer, clock = pair
    consumer.start_read(producer.hold("r", *LAYOUT), LOCAL)
    agent = consumer.agent
    agent.releasable = False  # NIXL refuses to release a READ it cannot cancel
    clock.now += 10.0
    assert consumer.poll() == [] and consumer.is_active("r")
    assert consumer.poll() == []  # still DRAINING: not reported while the handle may write
    agent.releasable = True
    (result,) = consumer.poll()
    assert result.state is ReadState.FAILED and isinstance(result.error, ReadDeadlineError)
    assert result.error.state == "reading" and agent.sent == []


def test_zero_tokens_only_notify(pair):
    producer, consumer, _ = pair
    consumer.start_read(producer.hold("z", [[], [2], [3], [4]], 0), LOCAL)
    (result,) = consumer.poll()
    assert result.ok and result.num_bytes == 0 and consumer.agent.posted == []
    assert len(consumer.agent.sent) == 1 and producer.poll() == ["z"]
