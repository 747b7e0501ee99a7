"""The connector's worker (integrations/vllm/worker.py) under a flood of hostile requests: one log line per cause
per interval, every refusal counted (issue 19 Deliver 3: a request cannot hurt the engine, nor flood its log).

The worker's own consumer is real (NIXL with UCX); no vLLM engine is needed: the orders are what the scheduler
would send for requests whose tickets carry a MAC that does not match (a client's edit).
"""

from __future__ import annotations

import logging
import secrets

import msgspec
from tiny_model import TINY_CONFIG

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import EngineConfig, auth, claims, wire
from hybrid_transfer.integrations.vllm.geometry import EngineCache
from hybrid_transfer.integrations.vllm.metadata import DeclineOrder, FailOrder, HybridConnectorMetadata
from hybrid_transfer.integrations.vllm.worker import WorkerSide
from hybrid_transfer.layout import RankGeometry, model_from_config

HOSTILE = 40  # requests of each kind


def _edited(i: int) -> wire.Ticket:
    good = claims.sign(wire.Ticket(engine_id="pa", incarnation=1, addresses=("tcp://127.0.0.1:5999",), tp_size=1,
                                   request_id=f"p{i}", nonce=secrets.randbits(63), block_ids=((0, 1), (2,), (3,), (4,)),
                                   num_tokens=20, state_position=20, lease_s=60.0), None)
    return msgspec.structs.replace(good, mac=bytes(len(good.mac)))


def test_declines_refused_for_a_bad_mac_log_once_per_interval_and_are_counted(caplog, monkeypatch):
    """Each refused decline used to log one WARNING: a hostile client chose how much the decode engine logged."""
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    cache = HybridCache.allocate(RankGeometry(model_from_config(TINY_CONFIG, name="tiny"), 1, 0), 16)
    worker = WorkerSide(EngineCache(cache, None, {}), EngineConfig(), engine_id="d", incarnation=1,
                        is_producer=False, is_consumer=True)
    meta = HybridConnectorMetadata(
        declines={f"d{i}": DeclineOrder(_edited(i), report=False) for i in range(HOSTILE)},
        fails={f"f{i}": FailOrder(_edited(HOSTILE + i), "a ticket the policy fails") for i in range(HOSTILE)})
    try:
        with caplog.at_level(logging.DEBUG, logger="hybrid_transfer.integrations.vllm.worker"):
            worker.start(meta)
            worker.results()
        declines = [r for r in caplog.records if "could not decline" in r.getMessage()]
        assert len(declines) == 1 and declines[0].levelno == logging.WARNING
        fails = [r for r in caplog.records if "fails without moving a byte" in r.getMessage()]
        assert len(fails) == 1
        assert worker.counts["declines_refused"] == 2 * HOSTILE and worker.counts["loads_failed"] == HOSTILE
        assert worker.consumer.num_links == 0 and worker.consumer.num_handshake_sockets == 0  # nothing connected
    finally:
        worker.consumer.close()
