"""The connector's scheduler half: runs in vLLM's engine-core process, one per engine.

It never touches NIXL. It decides who transfers what and when, and issues tickets itself:
``request_finished_all_groups`` must return ``kv_transfer_params`` synchronously, before any
worker runs again, so the ticket is drawn here from the engine card (every rank's identity,
collected once through ``set_xfer_handshake_metadata``) and the workers only pin what it names.

Prefill (``do_remote_decode`` in the request's params): the prompt is cut to N-1 tokens once,
at ``on_new_request``, for hybrid models (the decode side needs the recurrent state after N-1
tokens and computes token N itself); a finished request's blocks stay pinned (``delay_free``)
until every worker reports it in ``finished_sending``.

Decode (``do_remote_prefill`` and a ticket in the params): N-1 tokens (N for attention-only
models) are an asynchronous external hit; after allocation the read is ordered once; an abort
while reading is forwarded; a request that ends before its read was ordered is declined, so
the producer frees its blocks at once instead of at lease expiry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from hybrid_transfer.engine.tickets import EngineCard, issue_ticket
from hybrid_transfer.engine.wire import Ticket
from hybrid_transfer.errors import HybridTransferError
from hybrid_transfer.integrations.vllm import params as kvp
from hybrid_transfer.integrations.vllm.groups import GroupMap
from hybrid_transfer.integrations.vllm.metadata import DeclineOrder, HybridConnectorMetadata, ReadOrder

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_HANDED_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class SchedulerSide:
    """Scheduler-side state of one engine; the connector class forwards vLLM's hooks here."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, group_map: GroupMap,
                 attention_block_size: int, *, secret: bytes | None = None):
        self.kv_cache_config = kv_cache_config
        self._secret = secret  # keys the tickets' MACs (engine/claims.py); the workers check them with theirs
        self.group_map = group_map
        self.block_size = attention_block_size
        # Hybrids stop one token early (the decode side needs h(N-1)); attention-only models do not.
        self.backoff = 1 if kv_cache_config.has_mamba_layers else 0
        self.card: EngineCard | None = None  # the prefill engine's ranks, once vLLM handed them over
        self._holds: dict[str, Ticket] = {}
        self._reads: dict[str, ReadOrder] = {}
        self._declines: dict[str, DeclineOrder] = {}
        self._aborts: list[str] = []
        self._reading: set[str] = set()  # read ordered, not yet reported finished by the workers

    # ---- identity -----------------------------------------------------------------
    def set_card(self, card: EngineCard) -> None:
        """Every producer rank's card, gathered (vLLM hands them over once the workers registered their caches)."""
        self.card = card

    # ---- prefill ------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params or not params.get(kvp.DO_REMOTE_DECODE):
            return
        if self.backoff and not params.get(kvp.TRUNCATED) and request.num_prompt_tokens > self.backoff \
                and request.prompt_token_ids is not None:
            # Once per request: a preempted request comes back through the waiting queue, not here,
            # and the flag guards against an embedder re-adding it.
            del request.prompt_token_ids[-self.backoff:]
            del request._all_token_ids[-self.backoff:]
            request.num_prompt_tokens -= self.backoff
            params[kvp.TRUNCATED] = True
        request.max_tokens = 1

    def finished_prefill(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """A prefill request ended: issue its ticket and keep its blocks, or let vLLM free them."""
        if request.status not in _HANDED_OFF or not any(block_ids):
            return False, None
        if self.card is None:
            log.error("hybrid-transfer: no producer rank cards (kv_role without a producer, or no handshake metadata "
                      "yet); %s is not handed off", request.request_id)
            return False, None
        ours = self.group_map.to_ours(self.kv_cache_config.select_transfer_block_ids(block_ids))
        num_tokens = request.num_computed_tokens
        ours = self._clip(ours, num_tokens)
        ticket = issue_ticket(self.card, request.request_id, ours, num_tokens, secret=self._secret)
        self._holds[request.request_id] = ticket
        return True, kvp.prefill_result(ticket)

    def _clip(self, ours: tuple[tuple[int, ...], ...], num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Attention lists cover exactly the moved tokens; a state group keeps its one state block."""
        out = []
        for kind_is_attention, ids in zip(self.group_map.attention_mask, ours, strict=True):
            if kind_is_attention:
                out.append(ids[: -(-num_tokens // self.block_size)])
            else:
                out.append(ids[-1:])
        return tuple(out)

    # ---- decode -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """N-1 prompt tokens (N for attention-only models) load asynchronously; anything else computes locally.

        Called again and again while the request waits, so it only reads. A ticket that does not
        decode, or that moves another number of tokens than this prompt needs, is logged and the
        prompt computed here (update_state_after_alloc then declines it, so the producer frees).
        """
        params = request.kv_transfer_params
        if not params or not params.get(kvp.DO_REMOTE_PREFILL) or kvp.TICKET not in params:
            return 0, False
        ticket = self._ticket_of(request)
        if ticket is None:
            return 0, False
        expected = self._tokens_to_load(request)
        if ticket.num_tokens != expected:
            log.error("hybrid-transfer: %s carries a ticket for %d tokens, its %d-token prompt needs %d: computed "
                      "locally", request.request_id, ticket.num_tokens, len(request.prompt_token_ids or ()), expected)
            return 0, False
        if num_computed_tokens:
            # A local prefix hit: the read would overwrite shared cached blocks. Compute the rest here.
            log.info("hybrid-transfer: %s has %d tokens cached locally: not loaded", request.request_id,
                     num_computed_tokens)
            return 0, False
        return (expected, True) if expected > 0 else (0, False)

    def _tokens_to_load(self, request: Request) -> int:
        n = len(request.prompt_token_ids or ())
        return n - self.backoff if n > self.backoff else n

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get(kvp.DO_REMOTE_PREFILL) or kvp.TICKET not in params:
            return
        params[kvp.DO_REMOTE_PREFILL] = False  # one transfer per request, whatever happens next
        ticket = self._ticket_of(request)
        if ticket is None:
            return
        if num_external_tokens == 0:  # not loaded (local hit, refused ticket): the producer must still hear it
            self._declines[request.request_id] = DeclineOrder(ticket, report=False)
            return
        local = self.group_map.to_ours(self.kv_cache_config.select_transfer_block_ids(
            blocks.get_unhashed_block_ids_all_groups()))
        self._reads[request.request_id] = ReadOrder(ticket, local, self._tokens_to_load(request))
        self._reading.add(request.request_id)

    def get_loaded_kv_cache_group_ids(self) -> tuple[int, ...]:
        # Every transfer group: vLLM must not zero blocks the READ is filling.
        return self.kv_cache_config.transfer_group_ids

    def finished_decode(self, request: Request) -> None:
        """A decode request ended: forward an abort of its read, or decline a read never ordered."""
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if params.get(kvp.DO_REMOTE_PREFILL) and kvp.TICKET in params:
            # Ended before update_state_after_alloc: vLLM does not wait for us, the producer does.
            ticket = self._ticket_of(request)
            if ticket is not None:
                self._declines[rid] = DeclineOrder(ticket, report=False)
            params[kvp.DO_REMOTE_PREFILL] = False
            return
        order = self._reads.pop(rid, None)
        if order is not None:  # ordered this step, not yet sent to the workers: they never start it
            self._declines[rid] = DeclineOrder(order.ticket, report=True)
            self._reading.discard(rid)
        elif rid in self._reading and request.status is not RequestStatus.FINISHED_STOPPED \
                and request.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
            self._aborts.append(rid)

    def _ticket_of(self, request: Request) -> Ticket | None:
        try:
            return kvp.ticket_of(request.kv_transfer_params, request.request_id)
        except HybridTransferError as exc:
            log.error("hybrid-transfer: request %s carries unusable kv_transfer_params: %s", request.request_id, exc)
            return None

    # ---- every step ------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HybridConnectorMetadata:
        meta = HybridConnectorMetadata(holds=self._holds, reads=self._reads, aborts=self._aborts,
                                       declines=self._declines)
        self._holds, self._reads, self._aborts, self._declines = {}, {}, [], {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving or ():
            self._reading.discard(rid)

    def describe(self) -> dict[str, Any]:
        """Pending orders, for tests and logs."""
        return {"holds": sorted(self._holds), "reads": sorted(self._reads), "aborts": list(self._aborts),
                "declines": sorted(self._declines), "reading": sorted(self._reading)}
