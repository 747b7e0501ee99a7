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

Params come from the client (vLLM's request body): ``on_new_request`` judges them whole
(params.check_request_params) before anything acts on them, and no hook raises for a request.
Refused hand-offs run as plain requests; refused loads follow vLLM's ``kv_load_failure_policy``:
"fail" ends the request as an error before any decode compute (the workers report it failed at
once, touching no network), "recompute" computes the prompt here. ``counts`` tallies both.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.tickets import EngineCard, issue_ticket
from hybrid_transfer.engine.wire import Ticket
from hybrid_transfer.integrations.vllm import params as kvp
from hybrid_transfer.integrations.vllm.groups import GroupMap
from hybrid_transfer.integrations.vllm.metadata import DeclineOrder, FailOrder, HybridConnectorMetadata, ReadOrder

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_HANDED_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_MAX_REASON_CHARS = 200  # a refusal's reason as logged and sent to the workers (values may be huge)


@dataclass(frozen=True)
class _Load:
    """A decode request's judged params, kept from on_new_request until its load is ordered or it ends.

    ``ticket``: decoded (None when the params did not decode); ``refusal``: why it is not loaded
    (None: load it).
    """

    ticket: Ticket | None
    refusal: str | None = None


class SchedulerSide:
    """Scheduler-side state of one engine; the connector class forwards vLLM's hooks here."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, group_map: GroupMap,
                 attention_block_size: int, *, secret: bytes | None = None):
        self.kv_cache_config = kv_cache_config
        kvt = vllm_config.kv_transfer_config
        self.fail_bad_loads = kvt.kv_load_failure_policy == "fail"
        self._decode_only = kvt.is_kv_consumer and not kvt.is_kv_producer
        # The producer ranks' cap on pinned blocks, applied before a ticket is issued: a refused
        # hand-off gets no ticket and vLLM frees its blocks at once (docs/vllm.md#held-blocks).
        config = EngineConfig.from_dict(dict(kvt.kv_connector_extra_config or {}))
        self.max_held_blocks = config.held_blocks_cap(kv_cache_config.num_blocks)
        self._held: dict[str, int] = {}  # handed-off request -> blocks it pins, until finished_sending
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
        self._fails: dict[str, FailOrder] = {}
        # Live requests only: an entry leaves when its load is ordered or the request ends.
        self._loads: dict[str, _Load] = {}
        self._truncated: set[str] = set()  # prefill requests this connector cut (TRUNCATED is ours)
        # params_refused: hand-offs run as plain requests; loads_failed / loads_recomputed: refused
        # loads under kv_load_failure_policy "fail" / "recompute".
        self.counts: Counter[str] = Counter()

    # ---- identity -----------------------------------------------------------------
    def set_card(self, card: EngineCard) -> None:
        """Every producer rank's card, gathered (vLLM hands them over once the workers registered their caches)."""
        self.card = card

    # ---- prefill ------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """Judge the client's params once, before vLLM or any hook reads them; then cut a hand-off to N-1."""
        rid = request.request_id
        params = request.kv_transfer_params
        try:
            judged = kvp.check_request_params(params, internal_ok=rid in self._truncated)
        except Exception as exc:  # noqa: BLE001 - typed by contract; anything else must not reach add_request
            self._refuse(request, exc)
            return
        if judged.role is kvp.Role.LOAD:
            self._judge_load(request, judged.ticket)
        elif judged.role is kvp.Role.HAND_OFF:
            self._cut(request, params)

    def _refuse(self, request: Request, exc: Exception) -> None:
        """Params that failed the check: a load follows the failure policy, anything else runs as a plain request."""
        rid = request.request_id
        reason = _short(exc)
        params = request.kv_transfer_params
        if kvp.asks_to_load(params) or (self._decode_only and not isinstance(params, dict)):
            log.error("hybrid-transfer: request %s: refused kv_transfer_params (%s): %s", rid,
                      "fails" if self.fail_bad_loads else "computed locally", reason)
            self._loads[rid] = _Load(None, reason)
            # Truthy and inert: vLLM's own reads see no load, and finished_decode still runs at the end.
            request.kv_transfer_params = {kvp.DO_REMOTE_PREFILL: False, kvp.DO_REMOTE_DECODE: False}
        else:
            log.error("hybrid-transfer: request %s: refused kv_transfer_params, not handed off: %s", rid, reason)
            self.counts["params_refused"] += 1
            request.kv_transfer_params = None

    def _judge_load(self, request: Request, ticket: Ticket) -> None:
        rid = request.request_id
        expected = self._tokens_to_load(request)
        refusal = None
        if ticket.num_tokens != expected:
            refusal = (f"a ticket for {ticket.num_tokens} tokens, its {len(request.prompt_token_ids or ())}-token "
                       f"prompt needs {expected}")
        elif len(ticket.block_ids) != len(self.group_map.attention_mask):
            refusal = f"a ticket for {len(ticket.block_ids)} cache groups, this engine has {len(self.group_map.attention_mask)}"
        if refusal is not None:
            log.error("hybrid-transfer: request %s carries %s: %s", rid, refusal,
                      "fails" if self.fail_bad_loads else "computed locally")
        self._loads[rid] = _Load(ticket, refusal)

    def _cut(self, request: Request, params: dict) -> None:
        if self.backoff and not params.get(kvp.TRUNCATED) and request.num_prompt_tokens > self.backoff \
                and request.prompt_token_ids is not None:
            # Once per request: a preempted request comes back through the waiting queue, not here,
            # and the flag guards against an embedder re-adding it.
            del request.prompt_token_ids[-self.backoff:]
            del request._all_token_ids[-self.backoff:]
            request.num_prompt_tokens -= self.backoff
            params[kvp.TRUNCATED] = True
            self._truncated.add(request.request_id)
        request.max_tokens = 1

    def finished_prefill(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """A prefill request ended: issue its ticket and keep its blocks, or let vLLM free them."""
        self._truncated.discard(request.request_id)
        if request.status not in _HANDED_OFF or not any(block_ids):
            return False, None
        if self.card is None:
            log.error("hybrid-transfer: no producer rank cards (kv_role without a producer, or no handshake metadata "
                      "yet); %s is not handed off", request.request_id)
            return False, None
        ours = self.group_map.to_ours(self.kv_cache_config.select_transfer_block_ids(block_ids))
        num_tokens = request.num_computed_tokens
        ours = self._clip(ours, num_tokens)
        num_blocks = len({b for ids in ours for b in ids})
        num_held = sum(self._held.values())
        if num_held + num_blocks > self.max_held_blocks:
            log.error("hybrid-transfer: %s is not handed off: its %d blocks on top of the %d held exceed "
                      "max_held_blocks=%d; no ticket, vLLM frees its blocks now", request.request_id, num_blocks,
                      num_held, self.max_held_blocks)
            self.counts["hand_offs_refused"] += 1
            return False, None
        self._held[request.request_id] = num_blocks
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

        Called again and again while the request waits, so it only reads. A refused load under
        policy "fail" also counts as an asynchronous load: the workers then report it failed and
        vLLM ends the request before computing anything (the only way 0.33 fails a request from
        a connector). A local prefix hit computes here (update_state_after_alloc declines).
        """
        load = self._load_of(request)
        if load is None:
            return 0, False
        expected = self._tokens_to_load(request)
        if load.refusal is not None:
            return (expected, True) if self.fail_bad_loads and expected > 0 else (0, False)
        if num_computed_tokens:
            # A local prefix hit: the read would overwrite shared cached blocks. Compute the rest here.
            log.info("hybrid-transfer: %s has %d tokens cached locally: not loaded", request.request_id,
                     num_computed_tokens)
            return 0, False
        return (expected, True) if expected > 0 else (0, False)

    def _load_of(self, request: Request) -> _Load | None:
        """The request's judged load, judging it now when vLLM's add_request did not (direct hook calls)."""
        load = self._loads.get(request.request_id)
        if load is None and kvp.asks_to_load(request.kv_transfer_params):  # the flag is cleared once ordered
            self.on_new_request(request)
            load = self._loads.get(request.request_id)
        return load

    def _tokens_to_load(self, request: Request) -> int:
        n = len(request.prompt_token_ids or ())
        return n - self.backoff if n > self.backoff else n

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        load = self._load_of(request)
        if load is None:
            return
        del self._loads[rid]  # one transfer per request, whatever happens next
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get(kvp.DO_REMOTE_PREFILL):
            params[kvp.DO_REMOTE_PREFILL] = False
        if load.refusal is not None:
            if num_external_tokens:
                self.counts["loads_failed"] += 1
                self._fails[rid] = FailOrder(load.ticket, load.refusal)
                return
            self.counts["loads_recomputed"] += 1
        if num_external_tokens == 0 or load.refusal is not None:
            # Not loaded (local hit, refused ticket): a producer the ticket names must still hear it.
            if load.ticket is not None:
                self._declines[rid] = DeclineOrder(load.ticket, report=False)
            return
        local = self.group_map.to_ours(self.kv_cache_config.select_transfer_block_ids(
            blocks.get_unhashed_block_ids_all_groups()))
        self._reads[rid] = ReadOrder(load.ticket, local, self._tokens_to_load(request))
        self._reading.add(rid)

    def get_loaded_kv_cache_group_ids(self) -> tuple[int, ...]:
        # Every transfer group: vLLM must not zero blocks the READ is filling.
        return self.kv_cache_config.transfer_group_ids

    def finished_decode(self, request: Request) -> None:
        """A decode request ended: forward an abort of its read, or decline a read never ordered."""
        rid = request.request_id
        load = self._loads.pop(rid, None)
        if load is not None:
            # Ended before update_state_after_alloc: vLLM does not wait for us, the producer does.
            if load.ticket is not None:
                self._declines[rid] = DeclineOrder(load.ticket, report=False)
            return
        order = self._reads.pop(rid, None)
        if order is not None:  # ordered this step, not yet sent to the workers: they never start it
            self._declines[rid] = DeclineOrder(order.ticket, report=True)
            self._reading.discard(rid)
        elif rid in self._reading and request.status is not RequestStatus.FINISHED_STOPPED \
                and request.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
            self._aborts.append(rid)

    # ---- every step ------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HybridConnectorMetadata:
        meta = HybridConnectorMetadata(holds=self._holds, reads=self._reads, aborts=self._aborts,
                                       declines=self._declines, fails=self._fails)
        self._holds, self._reads, self._aborts, self._declines, self._fails = {}, {}, [], {}, {}
        return meta

    def holds_blocks(self) -> bool:
        """Whether a handed-off request's blocks are still pinned (until every worker reports it sent)."""
        return bool(self._held)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving or ():
            self._reading.discard(rid)
        for rid in output.finished_sending or ():
            self._held.pop(rid, None)

    def describe(self) -> dict[str, Any]:
        """Pending orders, for tests and logs."""
        return {"holds": sorted(self._holds), "reads": sorted(self._reads), "aborts": list(self._aborts),
                "declines": sorted(self._declines), "fails": sorted(self._fails), "reading": sorted(self._reading),
                "loads": sorted(self._loads), "truncated": sorted(self._truncated), "held": dict(self._held),
                "counts": dict(self.counts)}


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."
