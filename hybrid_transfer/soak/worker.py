"""One soak rank process: a Producer or a Consumer, polled whenever no command is waiting.

The embedder's part is played here: the producer fills each request's blocks with the oracle's
pattern and holds them; either side aborts a request after a scheduled number of its own polls
(random moments). The consumer checks every DONE request's local blocks against the oracle the
moment it is reported, then poisons them again (the embedder's reuse), so a wrong free shows up as
wrong bytes in a later request.
"""

from __future__ import annotations

import collections
import logging
import os
import tempfile
import time
import traceback

import msgspec

from hybrid_transfer.soak import messages as m

log = logging.getLogger(__name__)

# The built-in tiny hybrid model (8 layers: 2 full attention, 6 GDN; 1 KiB pages at TP1): fast to fill and check.
TINY_MODEL = {
    "num_hidden_layers": 8, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 8,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32", "dtype": "bfloat16",
}
_IDLE_S = 0.001


def geometry_of(model: str):
    from hybrid_transfer.layout import RankGeometry, load_preset, model_from_config

    spec = model_from_config(TINY_MODEL, name="tiny") if model == "tiny" else load_preset(model)
    return RankGeometry(spec, 1, 0, None)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Rank:
    def __init__(self, setup: m.Setup):
        import torch

        from hybrid_transfer.cache import HybridCache
        from hybrid_transfer.engine import Consumer, EngineConfig, Producer
        from hybrid_transfer.verify import poison

        torch.set_num_threads(1)  # thousands of tiny fills and checks: intra-op threads only add wake-ups
        self.setup = setup
        config = EngineConfig(lease_s=setup.lease_s, heartbeat_interval_s=setup.heartbeat_s,
                              read_deadline_s=setup.read_deadline_s, read_transport=setup.read_transport)
        self.config = config
        # A producer's cache in shared memory can be mapped by the consumer on this host (docs/soak.md#transports).
        self.cache = HybridCache.allocate(geometry_of(setup.model), setup.num_blocks,
                                          shared=setup.prefill and setup.read_transport != "nixl")
        if setup.prefill:
            self.engine = Producer(self.cache, config, engine_id=setup.engine_id, incarnation=setup.incarnation)
            self.address = self.engine.address
        else:
            poison(self.cache)
            self.engine = Consumer(self.cache, config, engine_id=setup.engine_id)
            self.address = ""
            self._record_sent(self.engine.agent)
        self.aborts: dict[str, int] = {}  # request id -> polls left before the embedder aborts it
        self.outcomes: dict[str, m.Outcome] = {}  # key -> how it ended here
        self.reading: dict[str, str] = {}  # consumer: request id -> key
        self.expected: dict[str, tuple] = {}  # consumer: key -> (RequestLayout, seed, edited)
        self.rival = None  # consumer: the second consumer (soak/rival.py), made at the first forge round
        self.rss_start = rss_kib()  # once the engine runs: growth from here is what the requests cost

    def _record_sent(self, agent) -> None:
        """Keep the last notifications this consumer's agent sent (sealed when a secret is set): replay material."""
        send = agent.send_notif

        def recording(peer, message):
            self.sent.append((peer, bytes(message)))
            return send(peer, message)

        self.sent: collections.deque = collections.deque(maxlen=16)
        self.send_raw = send  # forged and replayed traffic goes out here, unrecorded
        agent.send_notif = recording

    # ---- polling -------------------------------------------------------------------------
    def poll(self) -> None:
        for rid, left in list(self.aborts.items()):
            if left > 0:
                self.aborts[rid] = left - 1
                continue
            del self.aborts[rid]
            self.engine.abort(rid)
        if self.setup.prefill:
            for rid in self.engine.poll():
                self.aborts.pop(rid, None)  # an abort still scheduled must not hit a later request of this id
                self._ended(rid, m.Outcome("released"))
        else:
            for r in self.engine.poll():
                self._record(r)
            if self.rival is not None:
                self.rival.poll()

    def _ended(self, key: str, outcome: m.Outcome) -> None:
        old = self.outcomes.get(key)
        self.outcomes[key] = outcome if old is None else msgspec.structs.replace(old, times=old.times + 1)

    def _record(self, r) -> None:
        from hybrid_transfer.verify import POISON_BYTE

        key = self.reading.pop(r.request_id, r.request_id)
        self.aborts.pop(r.request_id, None)  # an abort still scheduled must not hit a replay of this ticket
        layout, seed, _ = self.expected.pop(key)
        verified = blocks_hold(self.cache, layout, seed) if r.ok else None
        for t in self.cache.tensors:  # the embedder reuses the blocks: poison them again
            pages = t.view(self.cache.num_blocks, self.cache.geometry.page_bytes)
            for group in layout.block_ids:
                for b in group:
                    pages[b].fill_(POISON_BYTE)
        self._ended(key, m.Outcome(r.state.value, r.cause.value if r.cause else None, verified))

    # ---- commands ------------------------------------------------------------------------
    def hold(self, cmd: m.Hold) -> m.Tickets:
        from hybrid_transfer.engine import encode_ticket
        from hybrid_transfer.verify import RequestLayout, fill_source

        out = []
        for it in cmd.items:
            layout = RequestLayout(it.block_ids, it.num_tokens)
            fill_source(self.cache, layout, it.seed)
            out.append(encode_ticket(self.engine.hold(it.request_id, it.block_ids, it.num_tokens)))
            self._schedule(it.request_id, it.abort_after)
        return m.Tickets(tuple(out))

    def _schedule(self, rid: str, abort_after: int | None) -> None:
        if abort_after == -1:
            self.engine.abort(rid)
        elif abort_after is not None:
            self.aborts[rid] = abort_after

    def read(self, cmd: m.Read) -> m.Done:
        from hybrid_transfer.engine import decode_ticket
        from hybrid_transfer.verify import RequestLayout

        for it in cmd.items:
            layout = RequestLayout(it.block_ids, it.num_tokens)
            try:
                ticket = decode_ticket(it.ticket)
                if it.edit:  # shift every block id by one: a ticket edited on its way
                    ticket = msgspec.structs.replace(ticket, block_ids=tuple(
                        tuple((b + 1) % self.cache.num_blocks for b in g) for g in ticket.block_ids))
                if ticket.request_id in self.reading:
                    raise RuntimeError(f"{ticket.request_id} is already being read here")
                self.engine.start_read(ticket, it.block_ids, expected_state_position=it.num_tokens)
            except Exception as exc:  # noqa: BLE001 - a refused read is an outcome of its own
                self._ended(it.key, m.Outcome("raised", type(exc).__name__))
                continue
            self.reading[ticket.request_id] = it.key
            self.expected[it.key] = (layout, it.seed, it.edit)
            self._schedule(ticket.request_id, it.abort_after)
        return m.Done()

    def wait(self, cmd: m.Wait) -> m.Outcomes:
        deadline = time.monotonic() + cmd.timeout_s
        while not all(k in self.outcomes for k in cmd.keys) and time.monotonic() < deadline:
            self.poll()
            time.sleep(_IDLE_S / 4)
        return m.Outcomes({k: self.outcomes.pop(k) for k in cmd.keys if k in self.outcomes})

    def forge(self, cmd: m.Forge) -> m.Forged:
        """Forged traffic from the consumer process (see messages.Forge); the producer must drop all of it."""
        from hybrid_transfer.engine import wire

        digest, sent = self.engine._digest, 0
        messages = [wire.encode(wire.Completion(request_id=rid, nonce=nonce, consumer_rank=0, expected_consumers=1),
                                digest) for rid, nonce in cmd.refs]
        messages.append(wire.encode(wire.Bye(consumer_rank=0), digest))
        messages += [os.urandom(64) for _ in range(cmd.garbage)]
        targets = [(cmd.producer_agent, message) for message in messages]
        targets += [(peer, message) for peer, message in self.sent if peer == cmd.producer_agent]  # replayed
        for peer, message in targets:
            try:
                self.send_raw(peer, message)
                sent += 1
            except Exception as exc:  # noqa: BLE001 - counted by what was sent
                log.info("forged notification not sent: %s", exc)
        return m.Forged(sent, self._stranger(cmd.producer_address), self._rival_acts(cmd))

    def _rival_acts(self, cmd: m.Forge) -> dict[str, int]:
        """The second consumer declines, aborts or reads the live tickets and tries hostile params of each."""
        import random

        from hybrid_transfer.soak.rival import Rival

        if not cmd.tickets:
            return {}
        if self.rival is None:
            self.rival = Rival(self.config, self.cache.geometry)
        self.rival.act(list(cmd.tickets), list(cmd.seeds), random.Random(cmd.seed), cmd.hostile)
        return self._rival_report()

    def _rival_report(self) -> dict[str, int]:
        if self.rival is None:
            return {}
        out = dict(self.rival.outcomes)
        self.rival.outcomes.clear()
        return out

    def _stranger(self, address: str) -> str:
        """A consumer holding the wrong secret tries to handshake: it must be refused."""
        from hybrid_transfer.cache import HybridCache
        from hybrid_transfer.engine import Consumer

        with tempfile.NamedTemporaryFile("w", suffix=".secret") as f:
            f.write(os.urandom(16).hex())
            f.flush()
            config = msgspec.structs.replace(self.config, secret_file=f.name)
            stranger = Consumer(HybridCache.allocate(self.cache.geometry, 8), config, engine_id="stranger")
            try:
                stranger.connect(address, timeout_s=5.0)
            except Exception as exc:  # noqa: BLE001 - the refusal is the expected outcome
                return type(exc).__name__
            finally:
                stranger.close()
        return ""

    def final(self, cmd: m.Final) -> m.FinalState:
        deadline = time.monotonic() + cmd.settle_s
        while time.monotonic() < deadline:
            self.poll()
            time.sleep(_IDLE_S)
        e, prefill = self.engine, self.setup.prefill
        return m.FinalState(
            pinned_blocks=e.num_held_blocks if prefill else 0, held_requests=e.num_held_requests if prefill else 0,
            quarantined_blocks=0 if prefill else e.num_quarantined_blocks, active=0 if prefill else e.num_active,
            live_handles=e.agent.num_live_handles if prefill else e.num_live_handles, rss_kib=rss_kib(), rss_start_kib=self.rss_start,
            metrics=msgspec.msgpack.encode(e.metrics()), terminal=dict(e.terminal_counts),
            rival=self._rival_report(), rival_state=self.rival.state() if self.rival is not None else {})


def blocks_hold(cache, layout, seed) -> bool:
    """Every page of the request's local blocks equals what a correct transfer leaves there."""
    import torch

    from hybrid_transfer.verify import expected_destination_many

    expected = expected_destination_many(cache, [(layout, seed)])
    index = torch.tensor(sorted(b for g in layout.block_ids for b in g), dtype=torch.int64)
    page = cache.geometry.page_bytes
    return all(torch.equal(a.view(cache.num_blocks, page)[index], w.view(cache.num_blocks, page)[index])
               for a, w in zip(cache.tensors, expected, strict=True))


def worker_main(conn, log_level: str = "WARNING") -> None:
    """Command loop of one rank process."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank: Rank | None = None
    try:
        while True:
            if conn.poll(_IDLE_S):
                cmd = m.decode_command(conn.recv_bytes())
                if isinstance(cmd, m.Stop):
                    break
                try:
                    reply = _handle(rank, cmd)
                    if isinstance(cmd, m.Setup):
                        rank = reply[0]
                        reply = reply[1]
                except Exception as exc:  # noqa: BLE001 - every failure goes back to the coordinator
                    log.debug("%s", traceback.format_exc())
                    reply = m.Failed(type(exc).__name__, str(exc))
                conn.send_bytes(m.encode(reply))
            if rank is not None:
                rank.poll()
    finally:
        if rank is not None:
            if rank.rival is not None:
                rank.rival.close()
            rank.engine.close()


def _handle(rank: Rank | None, cmd):
    if isinstance(cmd, m.Setup):
        new = Rank(cmd)
        return new, m.Ready(new.address, new.engine.agent.name, os.getpid(), rss_kib())
    if rank is None:
        raise RuntimeError(f"{type(cmd).__name__} before Setup")
    if isinstance(cmd, m.Hold):
        return rank.hold(cmd)
    if isinstance(cmd, m.Read):
        return rank.read(cmd)
    if isinstance(cmd, m.Connect):
        rank.engine.connect(cmd.address, timeout_s=cmd.timeout_s)
        return m.Done()
    if isinstance(cmd, m.Wait):
        return rank.wait(cmd)
    if isinstance(cmd, m.Forge):
        return rank.forge(cmd)
    if isinstance(cmd, m.Final):
        return rank.final(cmd)
    raise RuntimeError(f"unknown command {type(cmd).__name__}")
