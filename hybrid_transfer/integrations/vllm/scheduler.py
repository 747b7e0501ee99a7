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

Prefix caching (GDN state in ``mamba_cache_mode`` "align"): a decode request with a local hit of H
tokens loads only N-1-H of them: the read starts at H (``ReadOrder.first_token``) and moves the
attention blocks past the hit and the state at N-1; a hit of all N-1 tokens moves nothing
(docs/vllm.md#prefix-caching). Which block of a GDN group holds a request's state is vLLM's rule
(``state_block_index``).

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


def state_block_index(mamba_cache_mode: str, num_tokens: int, block_size: int) -> int:
    """Where a request's GDN state after ``num_tokens`` tokens sits in its block list of a state group.

    "align": one entry per block of tokens, the running state in the block holding the last one, every
    earlier entry null or a prefix-cache checkpoint; "none": the first entry (any later ones are
    speculative decoding's scratch blocks). docs/vllm.md#prefix-caching.
    """
    if mamba_cache_mode == "align":
        return max(0, -(-num_tokens // block_size) - 1)
    return 0


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
        self.vllm_config = vllm_config
        self.mamba_cache_mode = _mamba_cache_mode(kv_cache_config)
        self._block_size_checked = False
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
        self._check_block_size()
        try:
            judged = kvp.check_request_params(params, internal_ok=rid in self._truncated)
        except Exception as exc:  # noqa: BLE001 - typed by contract; anything else must not reach add_request
            self._refuse(request, exc)
            return
        if judged.role is kvp.Role.LOAD:
            self._judge_load(request, judged.ticket)
        elif judged.role is kvp.Role.HAND_OFF:
            self._cut(request, params)

    def _check_block_size(self) -> None:
        """Say once, loudly, when vLLM's scheduler splits prompts on another block size than its caches use.

        vLLM's CPU platform resets ``cache_config.block_size`` to 128 when the engine core re-runs its
        config checks at start, unless ``--block-size`` was given, while the cache groups keep the block
        size page-size unification chose (256 where the GDN state is float32). In align mode the
        scheduler then ends prefill chunks on the wrong boundaries: hits are lost, and a state can be
        cached under the wrong position. docs/vllm.md#prefix-caching.
        """
        if self._block_size_checked or self.mamba_cache_mode != "align":
            return
        self._block_size_checked = True
        configured = self.vllm_config.cache_config.block_size
        if configured != self.block_size:
            self.counts["block_size_mismatch"] += 1
            log.error("hybrid-transfer: vLLM's scheduler splits prefill chunks on %s-token blocks but the cache "
                      "groups use %d-token blocks: with prefix caching (align mode) vLLM may cache GDN states under "
                      "the wrong position. Start every engine with --block-size %d (docs/vllm.md#prefix-caching)",
                      configured, self.block_size, self.block_size)

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
        try:
            ours = self._clip(ours, num_tokens)
        except IndexError:
            log.error("hybrid-transfer: %s is not handed off: its block lists %s are too short for %d tokens",
                      request.request_id, [len(ids) for ids in ours], num_tokens)
            return False, None
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
        """Attention lists cover exactly the moved tokens; a state group keeps the one block holding the state
        after ``num_tokens`` (``state_block_index``). Raises IndexError when a list is too short."""
        out = []
        state_at = state_block_index(self.mamba_cache_mode, num_tokens, self.block_size)
        for kind_is_attention, ids in zip(self.group_map.attention_mask, ours, strict=True):
            if kind_is_attention:
                out.append(ids[: -(-num_tokens // self.block_size)])
            else:
                out.append((ids[state_at],))
        return tuple(out)

    # ---- decode -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """N-1 prompt tokens (N for attention-only models) load asynchronously, less a local prefix hit.

        Called again and again while the request waits, so it only reads. A refused load under
        policy "fail" also counts as an asynchronous load: the workers then report it failed and
        vLLM ends the request before computing anything (the only way 0.33 fails a request from
        a connector). ``num_computed_tokens`` is the local hit (block-aligned; in align mode it
        includes the GDN state there): the rest loads, and a hit of every token to load moves nothing
        (update_state_after_alloc declines the ticket).
        """
        load = self._load_of(request)
        if load is None:
            return 0, False
        expected = self._tokens_to_load(request)
        if load.refusal is not None:
            return (expected, True) if self.fail_bad_loads and expected > 0 else (0, False)
        remaining = expected - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

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
        # Every block of the request, the hit's included: the read indexes its lists from token 0 and starts
        # past the hit (docs/planner.md#prefix-hits). In align mode vLLM hashes (caches) blocks as soon as
        # they fill, so its unhashed lists may miss blocks the read must fill.
        num_tokens = self._tokens_to_load(request)
        hit = num_tokens - num_external_tokens
        every = self.group_map.to_ours(self.kv_cache_config.select_transfer_block_ids(blocks.get_block_ids()))
        try:
            local = self._clip(every, num_tokens)
        except IndexError:
            local = every  # too few blocks for the ticket: the workers' and the consumer's checks fail it by name
        if hit:
            self.counts["loads_after_hit"] += 1
        self._reads[rid] = ReadOrder(load.ticket, local, num_tokens, first_token=hit)
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


def _mamba_cache_mode(kv_cache_config: KVCacheConfig) -> str:
    """The GDN groups' ``mamba_cache_mode`` ("none" without state groups)."""
    for group in kv_cache_config.kv_cache_groups:
        mode = getattr(group.kv_cache_spec, "mamba_cache_mode", None)
        if mode is not None:
            return mode
    return "none"


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."
