"""The connector's worker half: one per TP rank, in vLLM's worker process, on its RPC thread.

A prefill rank owns a Producer over vLLM's cache; a decode rank owns a Consumer (created at
start on a decode-only engine, on its first read on a ``kv_both`` one, so a prefill-only engine opens no
second NIXL agent). vLLM calls every hook from one
thread, once per engine step, which is exactly the engine's threading contract: ``poll`` runs in
``get_transfer_results``, nothing here blocks on the network, and ``start_load_kv`` returns at once.

Failures are per request: vLLM 0.33 refuses block-level load errors for models with more than one
cache group, so a failed read is reported in ``failed_recving`` (and ``finished_recving``) and vLLM
applies its ``kv_load_failure_policy`` (recompute the prompt, or end the request as an error).

Nothing raises out of a hook: vLLM runs every hook for the whole batch, so an exception would
fail every request of the step. Each order is acted on alone; whatever it raises, typed or not
(a ZeroMQ or NIXL error), fails that request only and is logged. Every ticket is checked again
here (params.recheck_ticket) before anything connects or pins.

A hostile client can send a refused ticket with every request: each refusal (the worker's check, the
consumer's, a decline refused for a bad MAC or a producer not allowed) is counted in ``counts`` and
logged once per cause per interval (engine/log_gate.py), never once per request.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.consumer import Consumer
from hybrid_transfer.engine.lifecycle.state import ReadState
from hybrid_transfer.engine.log_gate import LogGate
from hybrid_transfer.engine.producer import Producer
from hybrid_transfer.engine.read_batch import Read
from hybrid_transfer.engine.tickets import encode_rank_card
from hybrid_transfer.errors import HybridTransferError, TicketError
from hybrid_transfer.integrations.vllm import params as kvp
from hybrid_transfer.integrations.vllm.geometry import EngineCache
from hybrid_transfer.integrations.vllm.metadata import FailOrder, HandshakeCard, HybridConnectorMetadata, ReadOrder
from hybrid_transfer.integrations.vllm.stats import Hit, HybridKVConnectorStats, ReadTally

log = logging.getLogger(__name__)


class WorkerSide:
    """Transfers of one TP rank: holds on prefill, reads on decode."""

    def __init__(self, engine: EngineCache, config: EngineConfig, *, engine_id: str, incarnation: int,
                 is_producer: bool, is_consumer: bool):
        self.engine = engine
        self.config = config
        self.engine_id = engine_id
        self.incarnation = incarnation
        geometry = engine.cache.geometry
        self.tp_rank, self.tp_size = geometry.tp_rank, geometry.tp_size
        self.is_consumer = is_consumer
        self.producer: Producer | None = None
        self._consumer: Consumer | None = None
        if is_producer:
            self.producer = Producer(engine.cache, config, engine_id=engine_id, incarnation=incarnation)
        elif is_consumer:  # a decode-only engine opens its agent now: NIXL's first import takes seconds, not a step's
            _ = self.consumer
        self._unheld: dict[str, float] = {}  # holds refused -> when to report them finished sending
        # Decode: ticket request id (the producer's) -> our request id, and what a finished read needs.
        self._reads: dict[str, tuple[str, ReadOrder]] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # reads_refused (the worker's or the consumer's check), loads_failed (the scheduler's fail orders),
        # declines_refused (a ticket not trusted with a decline: a bad MAC, a producer not allowed)
        self.counts: Counter[str] = Counter()
        self._log = LogGate(log, time.monotonic)
        self.tally = ReadTally(self.tp_rank)  # what vLLM's stats path takes after each step (stats.py)

    @property
    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(self.engine.cache, self.config, engine_id=f"{self.engine_id}-d")
        return self._consumer

    def card(self) -> HandshakeCard | None:
        """What the scheduler issues tickets from; None on a rank without a producer (nothing to hand off)."""
        return HandshakeCard(encode_rank_card(self.producer.rank_card)) if self.producer is not None else None

    # ---- each step ------------------------------------------------------------------
    def start(self, meta: HybridConnectorMetadata) -> None:
        """Act on one step's orders; returns without waiting for the network, and never raises."""
        for rid, ticket in meta.holds.items():
            self._guarded("hold", rid, self._hold, rid, ticket)
        if meta.reads and not self._guarded("reads", "the step's reads", self._read_all, meta.reads):
            for rid in meta.reads:  # an untyped failure of the whole call: none of them is tracked
                if rid not in self._finished_recving and not any(r == rid for r, _ in self._reads.values()):
                    self._fail(rid, None)
        for rid in meta.aborts:
            self._guarded("abort", rid, self._abort, rid)
        for rid, decline in meta.declines.items():
            self._guarded("decline", rid, self._decline, rid, decline.ticket)
            if decline.report:
                self._finished_recving.add(rid)
        for rid, fail in meta.fails.items():
            self._guarded("fail", rid, self._fail_order, rid, fail)

    def _guarded(self, what: str, rid: str, fn, *args) -> bool:
        """Run one request's order; an exception of any type is logged and stays with that request."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - an untyped error must not fail the batch (docstring)
            log.error("hybrid-transfer: rank %d: %s of %s failed: %s: %s", self.tp_rank, what, rid,
                      type(exc).__name__, str(exc)[:200])
            return False
        return True

    def _hold(self, rid: str, ticket) -> None:
        producer = self.producer
        if producer is None:
            log.error("hybrid-transfer: rank %d has no producer (kv_role) but was told to hold %s", self.tp_rank, rid)
            return
        try:
            kvp.recheck_ticket(ticket)
            producer.hold(rid, ticket=ticket)  # refuses a ticket that disagrees with this rank, before pinning
        except Exception as exc:  # noqa: BLE001 - typed refusals (the held-blocks cap) and untyped alike
            # vLLM keeps the blocks until finished_sending. A consumer may still read them with the
            # ticket it got: release them only after the lease a held request would have had.
            log.error("hybrid-transfer: rank %d cannot hold %s (its blocks return to vLLM after %.0f s): %s",
                      self.tp_rank, rid, self.config.lease_s, str(exc)[:200])
            self._unheld[rid] = time.monotonic() + self.config.lease_s

    def _read_all(self, reads: dict[str, ReadOrder]) -> None:
        """Every read of the step in one consumer call (Consumer.start_reads: one READ and one claim per
        producer agent with read_batching "per_step"); each refused order fails alone."""
        checked: list[tuple[str, ReadOrder, object]] = []
        for rid, order in reads.items():
            try:
                ticket = kvp.recheck_ticket(order.ticket)
                _check_local_ids(order, ticket, self.engine.cache.num_blocks)
            except HybridTransferError as exc:
                self.counts["reads_refused"] += 1
                self._log.log(logging.ERROR, f"read refused: {type(exc).__name__}",
                              "hybrid-transfer: read of %s refused by the worker's check: %s", rid, str(exc)[:200])
                self._fail(rid, None)  # a ticket the worker refuses is not trusted with a decline either
                continue
            checked.append((rid, order, ticket))
        if not checked:
            return
        errors = self.consumer.start_reads([Read(ticket, order.local_block_ids, order.expected_state_position,
                                                 order.first_token) for _, order, ticket in checked])
        for (rid, order, ticket), exc in zip(checked, errors, strict=True):
            if exc is not None:
                self.counts["reads_refused"] += 1
                self._log.log(logging.ERROR, f"read refused: {type(exc).__name__}",
                              "hybrid-transfer: read of %s refused before any byte moved: %s: %s", rid,
                              type(exc).__name__, str(exc)[:200])
                # Typed: the producer frees now, not at lease expiry; untyped: nothing to trust a decline with.
                self._fail(rid, ticket if isinstance(exc, HybridTransferError) else None)
            else:
                self._reads[ticket.request_id] = (rid, order)

    def _fail_order(self, rid: str, fail: FailOrder) -> None:
        self.counts["loads_failed"] += 1
        self._log.warning("load failed before any byte", "hybrid-transfer: load of %s fails without moving a byte: %s",
                          rid, fail.reason)
        self._fail(rid, fail.ticket)

    def _fail(self, rid: str, ticket) -> None:
        """Report ``rid`` finished and failed receiving (vLLM applies kv_load_failure_policy); decline ``ticket``."""
        self._finished_recving.add(rid)
        self._failed_recving.add(rid)
        if ticket is not None:
            self._guarded("decline", rid, self._decline, rid, ticket)

    def _abort(self, rid: str) -> None:
        key = next((k for k, (r, _) in self._reads.items() if r == rid), None)
        if key is not None:
            self.consumer.abort(key)

    def _decline(self, rid: str, ticket) -> None:
        try:
            self.consumer.decline(ticket)
        except HybridTransferError as exc:  # the producer's lease frees its blocks instead
            self.counts["declines_refused"] += 1
            self._log.warning(f"decline refused: {type(exc).__name__}", "hybrid-transfer: could not decline %s: %s",
                              rid, str(exc)[:200])

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call; never raises."""
        sending: set[str] = set()
        if self.producer is not None:
            try:
                sending.update(self.producer.poll())
            except Exception as exc:  # noqa: BLE001 - a poll failure must not fail the step (module docstring)
                log.error("hybrid-transfer: rank %d: producer poll failed: %s: %s", self.tp_rank,
                          type(exc).__name__, str(exc)[:200])
        now = time.monotonic()
        for rid in [r for r, at in self._unheld.items() if at <= now]:
            del self._unheld[rid]
            sending.add(rid)
        if self._consumer is not None:
            try:
                results = self._consumer.poll()
            except Exception as exc:  # noqa: BLE001 - as above; the consumer's deadlines still end its reads
                log.error("hybrid-transfer: rank %d: consumer poll failed: %s: %s", self.tp_rank,
                          type(exc).__name__, str(exc)[:200])
                results = []
            for result in results:
                entry = self._reads.pop(result.request_id, None)
                self.tally.on_read(result, self._hit_of(entry[1], result) if entry is not None else None)
                if entry is None:
                    continue
                rid, order = entry
                self._finished_recving.add(rid)
                if result.state is ReadState.DONE:
                    self._guarded("zero tail", rid, self._zero_tail, order)
                elif result.state is ReadState.ABORTED:
                    # An abort that came before the producer link was ready told no producer rank:
                    # a decline does, once linked (a rank that already heard counts it as a duplicate).
                    self._guarded("decline", rid, self._decline, rid, order.ticket)
                elif result.state is ReadState.FAILED:
                    log.warning("hybrid-transfer: read of %s failed (%s): vLLM applies kv_load_failure_policy", rid,
                                result.error)
                    self._guarded("zero", rid, self._zero_attention_blocks, result.local_block_ids)
                    self._failed_recving.add(rid)
        self._log.flush()
        recving, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return sending, recving, failed

    def _zero_tail(self, order: ReadOrder) -> None:
        """Zero what the read left unwritten in the last attention block it filled.

        vLLM skips its own zeroing of blocks an asynchronous load fills (it would race the READ). On a
        token-major interior the plan moves valid tokens only: the token tail of the last kernel page
        and the later kernel pages of the block are stale and zeroed here. On any other interior the
        last kernel page holding a token moved whole and nothing inside it is touched: only the later,
        wholly unmoved kernel pages of the block are zeroed (docs/attention-layouts.md#page-interiors).
        """
        g = self.engine.cache.geometry
        n = order.ticket.num_tokens
        end = g.moved_token_end(n)
        rem = end % g.block_size
        if rem == 0:
            return
        ratio = g.kernel_ratio
        first_kernel, within = divmod(rem, g.kernel_block_size)  # within > 0 only on a token-major interior
        for group_index, is_attention in enumerate(self.engine.group_map.attention_mask):
            if not is_attention:
                continue
            block = order.local_block_ids[group_index][n // g.block_size]
            partial = block * ratio + first_kernel  # the kernel page holding the last token, if it is cut
            unmoved = partial + (within > 0)  # the first kernel page no byte of the read reached
            for layer in g.tensor_map.groups[group_index].layers:
                view = self.engine.attention_views[layer]  # [kernel blocks, heads, tokens, K|V]
                if within:
                    view[partial, :, within:].zero_()
                view[unmoved: block * ratio + ratio].zero_()

    def _hit_of(self, order: ReadOrder, result) -> Hit:
        """What the order's local prefix hit saved (its tokens, attention blocks and bytes on this rank), and the
        attention blocks the read wrote (the result's blocks: the hit's are not among them)."""
        g = self.engine.cache.geometry
        mask = self.engine.group_map.attention_mask
        blocks = order.first_token // g.block_size * sum(mask)
        written = sum(len(ids) for ids, attn in zip(result.local_block_ids, mask, strict=True) if attn)
        return Hit(order.first_token, blocks, order.first_token * g.kv_bytes_per_token * g.num_attention_layers,
                   written)

    def _zero_attention_blocks(self, written: tuple[tuple[int, ...], ...]) -> None:
        """A failed read may have filled part of its blocks, and vLLM skipped zeroing them: zero them whole.

        Safe here: a failed request is reported only once no NIXL handle can write its blocks.
        vLLM's recompute then rewrites the prompt's tokens over zeros, not over stale bytes. ``written``: the
        result's blocks, which leave out a prefix hit's (other requests may share them): never touched.
        """
        g = self.engine.cache.geometry
        ratio = g.kernel_ratio
        for group_index, is_attention in enumerate(self.engine.group_map.attention_mask):
            if not is_attention:
                continue
            for block in written[group_index]:
                for layer in g.tensor_map.groups[group_index].layers:
                    self.engine.attention_views[layer][block * ratio: (block + 1) * ratio].zero_()

    def stats(self) -> HybridKVConnectorStats | None:
        """This rank's transfers since the last call (vLLM's get_kv_connector_stats); None when none; never raises."""
        try:
            return self.tally.take(self.counts, self.producer)
        except Exception as exc:  # noqa: BLE001 - stats must not fail the step (module docstring)
            self._log.warning(f"stats failed: {type(exc).__name__}", "hybrid-transfer: rank %d: stats failed: %s",
                              self.tp_rank, str(exc)[:200])
            return None

    def close(self) -> None:
        for engine in (self._consumer, self.producer):
            if engine is not None:
                engine.close()


def _check_local_ids(order: ReadOrder, ticket, num_blocks: int) -> None:
    """The scheduler's local block lists: one per ticket group, each id inside this rank's cache."""
    if len(order.local_block_ids) != len(ticket.block_ids):
        raise TicketError(f"{len(order.local_block_ids)} local block lists for {len(ticket.block_ids)} ticket groups",
                          request_id=ticket.request_id)
    for group in order.local_block_ids:
        for block in group:
            if not 0 <= block < num_blocks:
                raise TicketError(f"local block {block} outside [0, {num_blocks})", request_id=ticket.request_id,
                                  block_id=block)
