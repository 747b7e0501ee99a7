"""Reads batched per step (issue 20): every request a consumer rank starts in one step, posted together.

docs/lifecycle.md#batched-reads. ``Consumer.start_reads`` admits each request as ``start_read`` does
(the same checks, a bad one fails alone) and plans it with the planner's per-shape recipes; this
module then posts them in one pass:

- one READ per (producer agent, step): the direct sources of every request on that agent, their
  descriptor rows concatenated in request order (``batch_plans``: exactly the per-request plans'
  rows, one after another). Each request holds a SharedRead of that handle (engine/agent.py) with
  its own bytes and descriptors. Sources pack mode reads through staging are posted per request
  (engine/pack/reader.py), as before;
- one Claims per producer agent, listing each request with its digest (engine/claims.py); the
  producer answers with one ClaimReplies, a verdict per request;
- completions wait in an ``Outbox`` and leave as one Completions per producer rank per poll.

Semantics: a handle's error fails every request in it (cause ``nixl``, or ``source_lost``); an
abort, a revocation or a refused claim ends only its own request, whose blocks stay quarantined
until the shared handle is released, which happens once every request sharing it has let go.
A handle's requests finish together: a small request batched with a long one waits for it
(benchmarks/read_batch_hol.py measures that cost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hybrid_transfer.engine import claims, wire
from hybrid_transfer.engine.agent import SharedRead
from hybrid_transfer.engine.lifecycle.state import ReadState, transition
from hybrid_transfer.errors import EngineError
from hybrid_transfer.plan.types import PackSourcePlan, ReadPlan, SourcePlan


class Read(NamedTuple):
    """One request of a step: what ``Consumer.start_read`` takes."""

    ticket: wire.Ticket
    local_block_ids: Sequence[Sequence[int]]
    expected_state_position: int | None = None
    first_token: int = 0  # a local prefix hit's end (Consumer.start_read)


class Checked(NamedTuple):
    """A request that passed its own checks (``Consumer._check``), not yet registered or planned."""

    ticket: wire.Ticket
    ids: tuple  # local block ids per group, tuples of ints (checked by engine/inputs.py)
    signed: bool
    known: Any  # the EngineLink of the ticket's engine, or None
    ready: bool  # ``known`` is ready and at the ticket's addresses: plan now
    digest: bytes  # claims.digest_of(ticket), computed once for the MAC check and the claim
    first_token: int = 0


@dataclass(frozen=True)
class SourceBatch:
    """One READ of a step from one source rank: every request's direct rows, concatenated in request order."""

    source_rank: int
    local: np.ndarray  # Nx3 int64 (addr, length, device), as SourcePlan.local_descs
    remote: np.ndarray
    rows: tuple[tuple[int, int, int], ...]  # (request index, first row, end row) into local / remote


@dataclass(frozen=True)
class BatchPlan:
    """The plan of one step's requests against one producer engine."""

    plans: tuple[ReadPlan, ...]
    reads: tuple[SourceBatch, ...]  # direct sources, one per source rank, in the order ranks first appear
    staged: tuple[tuple[int, PackSourcePlan], ...]  # (request index, source) read through staging, per request

    @property
    def num_descriptors(self) -> int:
        return sum(int(r.local.shape[0]) for r in self.reads) + sum(s.num_descriptors for _, s in self.staged)


def batch_plans(plans: Sequence[ReadPlan]) -> BatchPlan:
    """The step's READs: per source rank, the concatenation of each request's direct rows."""
    parts: dict[int, list[tuple[int, SourcePlan]]] = {}
    staged = []
    for i, plan in enumerate(plans):
        for src in plan.sources:
            if isinstance(src, SourcePlan):
                parts.setdefault(src.source_rank, []).append((i, src))
            else:
                staged.append((i, src))
    reads = []
    for rank, members in parts.items():
        local, remote = _stacked_descs([s for _, s in members])
        rows, first = [], 0
        for i, s in members:
            rows.append((i, first, first + s.num_descriptors))
            first += s.num_descriptors
        reads.append(SourceBatch(rank, local, remote, tuple(rows)))
    return BatchPlan(tuple(plans), tuple(reads), tuple(staged))


def _stacked_descs(sources: Sequence[SourcePlan]) -> tuple[np.ndarray, np.ndarray]:
    """The sources' local and remote Nx3 rows, one after another: their columns joined, then stacked once."""
    n = sum(int(s.length.shape[0]) for s in sources)
    local, remote = np.empty((n, 3), np.int64), np.empty((n, 3), np.int64)
    np.concatenate([s.local_addr for s in sources], out=local[:, 0])
    np.concatenate([s.remote_addr for s in sources], out=remote[:, 0])
    np.concatenate([s.length for s in sources], out=local[:, 1])
    remote[:, 1] = local[:, 1]
    devices = {(s.local_device, s.remote_device) for s in sources}
    if len(devices) == 1:
        ((local[:, 2], remote[:, 2]),) = devices
    else:  # sources of one rank on other devices (not a layout the planner makes today)
        counts = [int(s.length.shape[0]) for s in sources]
        local[:, 2] = np.repeat([s.local_device for s in sources], counts)
        remote[:, 2] = np.repeat([s.remote_device for s in sources], counts)
    return local, remote


def plan_batch(planner: Any, items: Sequence[tuple], mode: Any, cost: Any = None) -> BatchPlan:
    """Plan every (local ids, remote ids, num_tokens) of ``items`` against one planner in one pass
    (``Planner.plan_many``), then batch them; raises the first request's PlanError, if any."""
    plans = planner.plan_many(items, mode, cost=cost)
    for plan in plans:
        if isinstance(plan, Exception):
            raise plan
    return batch_plans(plans)


class Outbox:
    """Completions waiting for the end of the call, one list per producer agent (sent as Completions)."""

    def __init__(self) -> None:
        self._entries: dict[str, list[wire.CompletionEntry]] = {}

    def add(self, peer: str, entry: wire.CompletionEntry) -> None:
        self._entries.setdefault(peer, []).append(entry)

    def flush(self, send: Callable[[str, Any], bool], rank: int) -> tuple[int, int]:
        """Send every waiting list (MAX_BATCH entries a message); (entries sent, entries that failed)."""
        sent = failed = 0
        entries, self._entries = self._entries, {}
        for peer, items in entries.items():
            for first in range(0, len(items), wire.MAX_BATCH):
                chunk = tuple(items[first:first + wire.MAX_BATCH])
                if send(peer, wire.Completions(consumer_rank=rank, entries=chunk)):
                    sent += len(chunk)
                else:
                    failed += len(chunk)
        return sent, failed


def plan_step(consumer: Any, checked: Sequence[tuple[int, Checked]]) -> dict[int, ReadPlan | Exception]:
    """Every ready request of a step planned in one pass per producer engine (``Planner.plan_many``)."""
    per_link: dict[int, list[tuple[int, Checked]]] = {}
    for i, c in checked:
        if c.ready:
            per_link.setdefault(id(c.known), []).append((i, c))
    out: dict[int, ReadPlan | Exception] = {}
    pack = consumer._pack
    for group in per_link.values():
        link = group[0][1].known.resolve()
        items = [(c.ids, c.ticket.block_ids, c.ticket.num_tokens, c.first_token) for _, c in group]
        try:
            plans = link.planner.plan_many(items, pack.plan_mode, cost=pack.cost_for(link))
        except Exception:  # noqa: BLE001 - not a PlanError: each request again alone, so it stays with its own
            plans = [_plan_alone(consumer, c) for _, c in group]
        out.update((i, plan) for (i, _), plan in zip(group, plans, strict=True))
    return out


def _plan_alone(consumer: Any, c: Checked) -> ReadPlan | Exception:
    try:
        return consumer._plan(c.ticket, c.ids, c.known, c.first_token)
    except Exception as exc:  # noqa: BLE001 - it stays with its request
        return exc


def send_claims(consumer: Any, ready: Sequence[tuple[Any, ReadPlan]]) -> None:
    """One Claims per source agent, listing every request of the step that reads from it."""
    per_agent: dict[str, list[wire.ClaimEntry]] = {}
    for req, plan in ready:
        link = req.link.resolve()
        t = req.ticket
        entry = wire.ClaimEntry(request_id=t.request_id, nonce=t.nonce, digest=req.digest or claims.digest_of(t))
        sources = plan.sources
        agents = (link.agents[sources[0].source_rank],) if len(sources) == 1 else \
            dict.fromkeys(link.agents[src.source_rank] for src in sources)
        for agent in agents:
            req.awaiting_claims.add(agent)
            per_agent.setdefault(agent, []).append(entry)
    for agent, entries in per_agent.items():
        for first in range(0, len(entries), wire.MAX_BATCH):
            chunk = tuple(entries[first:first + wire.MAX_BATCH])
            if consumer._send_body(agent, wire.Claims(consumer_rank=consumer.tp_rank, entries=chunk)):
                consumer.stats.claims_sent += len(chunk)


def post_step(consumer: Any, ready: Sequence[tuple[Any, ReadPlan]], now: float) -> None:
    """Post a step's admitted requests (each WAITING_PEER with its plan): the claims and the READs.

    The claims leave before the READs where a post may copy the bytes inside the call (a CPU host): their
    round trip then overlaps the copy. On a GPU every direct READ only queues its copy, so they are posted
    first, which starts the copy sooner, and the claims follow before any staged read (docs/lifecycle.md#planned-trust).
    Either way DONE waits for every confirmation. A request that is no longer waiting (ended meanwhile, or
    listed twice) is left out, and one whose post failed claims nothing.
    """
    ready = list({id(req): (req, plan) for req, plan in ready if req.state is ReadState.WAITING_PEER}.values())
    if not ready:
        return
    groups: dict[int, tuple[Any, list]] = {}
    pairs: dict[int, tuple] = {}  # id(plan.notify) -> its (source rank, expected consumers): a planner's plans share one
    for req, plan in ready:
        transition(req, ReadState.READING, now)
        notify = pairs.get(id(plan.notify))
        if notify is None:
            notify = pairs[id(plan.notify)] = tuple((n.source_rank, n.expected_consumers) for n in plan.notify)
        req.notify = notify
        link = req.link.resolve()
        groups.setdefault(id(link), (link, []))[1].append((req, plan))
    claims_first = not consumer._posts_queue_copies
    if claims_first:
        send_claims(consumer, ready)
    pack = consumer._pack
    for req, _ in ready:
        pack.on_post(req, now)
    batches = []
    for link, group in groups.values():
        batch = batch_plans([plan for _, plan in group])
        batches.append((link, group, batch))
        for read in batch.reads:
            _post_read(consumer, link.agents[read.source_rank], read, [req for req, _ in group], now)
    if not claims_first:
        send_claims(consumer, [(req, plan) for req, plan in ready if req.state is ReadState.READING])
    for link, group, batch in batches:
        for i, src in batch.staged:
            req = group[i][0]
            if req.state is not ReadState.READING:
                continue
            try:
                consumer.stats.reads_posted += pack.post(req, src, link)
            except EngineError as exc:
                consumer._on_post_error(req, link.agents[src.source_rank], exc, now)


def _post_read(consumer: Any, peer: str, read: SourceBatch, reqs: Sequence[Any], now: float) -> None:
    """One READ for every request of ``read`` still reading (one whose earlier post failed is left out)."""
    rows = [(i, a, b) for i, a, b in read.rows if reqs[i].state is ReadState.READING]
    if not rows:
        return
    local, remote = read.local, read.remote
    if len(rows) != len(read.rows):
        local = np.concatenate([read.local[a:b] for _, a, b in rows])
        remote = np.concatenate([read.remote[a:b] for _, a, b in rows])
        first, shifted = 0, []
        for i, a, b in rows:
            shifted.append((i, first, first + b - a))
            first += b - a
        rows = shifted
    try:
        handle = consumer.reads.post_read(peer, local, remote)  # NIXL, or one copy over a mapping (engine/mapped/)
    except EngineError as exc:
        for i, _, _ in rows:
            consumer._on_post_error(reqs[i], peer, exc, now)
        return
    consumer.stats.reads_posted += 1
    # Each request's bytes from one cumulative sum: its rows are the slice [a, b) of the READ's.
    ends = np.zeros(local.shape[0] + 1, np.int64)
    np.cumsum(local[:, 1], out=ends[1:])
    bounds = np.array([(a, b) for _, a, b in rows], np.int64)
    row_bytes = (ends[bounds[:, 1]] - ends[bounds[:, 0]]).tolist()
    for (i, a, b), num_bytes in zip(rows, row_bytes, strict=True):
        share = SharedRead(handle, b - a, num_bytes)
        req = reqs[i]
        req.handles.append(share)
        req.num_bytes += share.num_bytes
        req.num_descriptors += share.num_descriptors
