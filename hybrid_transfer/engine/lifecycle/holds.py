"""A producer rank's held requests: pins, leases, completions, aborts, revocations; no NIXL, no sockets.

The Producer feeds it what arrives (completions, heartbeats, revocation acks) and what the
embedder asks (hold, abort, step fences), sends the messages that follow, and hands back what
it releases. Everything runs on the producer's injected clock.

Rules:
- A hold pins its blocks, counted per hold (prefix caching may share attention blocks); at most
  ``max_pinned_blocks`` distinct blocks are pinned at once, and a hold beyond that is refused before it
  pins anything (HoldCapacityError).
- A hold answers to its readers (docs/lifecycle.md#who-reports): once a claim for consumer rank r was
  confirmed, only that claim's agent reports for r; another agent's report is NOT_READER (counted by the
  caller, ignored here). Before any claim for r, a report from any handshaken agent counts for r (a
  decline, or a DONE from a consumer rank that read nothing from this rank), and the Producer then answers
  later claims for r ENDED. So no report can end a hold while a confirmed reader has not reported, and a
  READ that was in flight when a report ended the hold is never reported DONE (its claim is refused).
- It ends FREED once every expected consumer rank has reported (done, aborted or failed),
  EXPIRED when its lease runs out first, ABORTED when the embedder aborts it.
- An abort cannot see whether a READ is in flight, so it asks: every consumer agent that may be
  reading gets a Revoke (a consumer reads from a rank only after that rank's welcome, so these
  are the welcomed agents). The hold stays ABORTING until each has acknowledged, every expected
  consumer rank has reported, or the lease expires; with no such agent it ends at once. A
  consumer that has taken in a revocation never reports that request DONE, so after the last
  ack nobody will trust bytes read from these blocks any more and they may be reused.
- Aborts and expiries stay listed as revocations for one lease: a consumer agent that arrives
  later learns them in its welcome, before its first READ.
- An ended hold keeps its blocks pinned until their step fences have passed; then they are released.
- Fast reclaim (docs/lifecycle.md): when the agent that claimed a hold is gone, the Producer aborts
  the hold exactly as above (``claimed_by``); ``watched_agents`` are the agents it checks for that.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from hybrid_transfer.engine.claims import EndedTickets
from hybrid_transfer.engine.lifecycle.fences import StepFences
from hybrid_transfer.engine.lifecycle.lease import LeaseBook
from hybrid_transfer.engine.lifecycle.state import Hold, HoldState, transition
from hybrid_transfer.errors import FenceError, HoldCapacityError, RequestStateError
from hybrid_transfer.identity_enum import IdentityEnum


class Heard(IdentityEnum):
    """What one consumer report did to its hold."""

    COUNTED = "counted"  # valid, the hold still waits for other consumer ranks
    ENDED = "ended"  # valid, and it ended the hold
    DUPLICATE = "duplicate"  # this consumer rank already reported
    INCONSISTENT = "inconsistent"  # an expected-consumer count that contradicts an earlier one
    STALE = "stale"  # the hold no longer waits for anything (it is ending or ended)
    NOT_READER = "not_reader"  # another agent than the one whose claim for the rank was confirmed: ignored


class HoldBook:
    """Holds of one producer rank; used by its owner thread only."""

    def __init__(self, clock: Callable[[], float], lease_s: float, fences: StepFences | None = None,
                 max_pinned_blocks: int | None = None):
        self._clock = clock
        self.lease_s = float(lease_s)
        self.max_pinned_blocks = max_pinned_blocks  # None: no cap (the Producer always passes one)
        self.fences = fences if fences is not None else StepFences()
        self._holds: dict[str, Hold] = {}
        self._pins: dict[int, int] = {}  # block id -> holds pinning it (ended holds until released)
        self._leases = LeaseBook(lease_s)
        self._releasing: list[Hold] = []  # ended, blocks pinned until their fences pass
        # (request id, nonce) -> when the revocation lapses; inserted in lapse order (one clock, one lease_s)
        self._revoked: dict[tuple[str, int], float] = {}
        self.terminal_counts: Counter[str] = Counter()  # HoldState value -> holds that ended in it
        self.ended = EndedTickets(clock, lease_s)  # claims on these are replays (engine/claims.py)

    # ---- holding ------------------------------------------------------------------
    def add(self, request_id: str, nonce: int, block_ids: tuple[tuple[int, ...], ...], num_tokens: int) -> Hold:
        """Pin a request's blocks and start its lease.

        Raises:
            RequestStateError: the request is already held.
            FenceError: a step that writes one of the blocks has not finished (hold only complete writes).
            HoldCapacityError: its blocks not pinned yet would take the pinned blocks past ``max_pinned_blocks``.
        """
        if request_id in self._holds:
            raise RequestStateError("is already held", request_id=request_id, state=self._holds[request_id].state.value)
        flat = [b for group in block_ids for b in group]
        pending = self.fences.pending(flat)
        if pending:
            raise FenceError(f"request {request_id!r} held before its writes finished", block_ids=list(pending),
                             steps=list(pending.values()), finished_step=self.fences.finished_step)
        if self.max_pinned_blocks is not None:
            asked = len({b for b in flat if b not in self._pins})  # blocks shared with a live hold cost nothing
            if len(self._pins) + asked > self.max_pinned_blocks:
                raise HoldCapacityError(request_id=request_id, held=len(self._pins), asked=asked,
                                        cap=self.max_pinned_blocks)
        now = self._clock()
        hold = Hold(request_id, nonce, block_ids, num_tokens, held_at=now, changed_at=now)
        hold.expires_at = self._leases.start(request_id, now)
        self._holds[request_id] = hold
        for b in flat:
            self._pins[b] = self._pins.get(b, 0) + 1
        return hold

    def get(self, request_id: str) -> Hold | None:
        """A hold that has not ended yet."""
        return self._holds.get(request_id)

    # ---- what consumers say -------------------------------------------------------------
    def report(self, hold: Hold, consumer_rank: int, expected_consumers: int, agent: str) -> Heard:
        """``agent`` reports consumer rank ``consumer_rank`` finished with the request (done, aborted or failed).

        Once a claim for the rank was confirmed only its agent speaks for the rank; before that, any agent
        does (the caller has checked that it handshaked).
        """
        reader = hold.claimed.get(consumer_rank)
        if reader is not None and agent != reader:
            return Heard.NOT_READER
        if consumer_rank in hold.heard:
            return Heard.DUPLICATE
        if hold.expected_consumers is None:
            hold.expected_consumers = expected_consumers
        elif expected_consumers != hold.expected_consumers:
            return Heard.INCONSISTENT
        hold.heard[consumer_rank] = agent
        if len(hold.heard) < hold.expected_consumers:
            return Heard.COUNTED
        self._end(hold, HoldState.ABORTED if hold.state is HoldState.ABORTING else HoldState.FREED)
        return Heard.ENDED

    def renew(self, hold: Hold) -> None:
        """A heartbeat: the lease runs ``lease_s`` from now (never shorter than before)."""
        until = self._leases.renew(hold.request_id, self._clock())
        if until is not None:
            hold.expires_at = until

    def ack(self, request_id: str, nonce: int, agent: str) -> Heard:
        """A consumer agent confirms a revocation."""
        hold = self._holds.get(request_id)
        if hold is None or hold.nonce != nonce or agent not in hold.awaiting_acks:
            return Heard.STALE
        hold.awaiting_acks.discard(agent)
        if hold.awaiting_acks:
            return Heard.COUNTED
        self._end(hold, HoldState.ABORTED)
        return Heard.ENDED

    def forget_agent(self, agent: str) -> list[Hold]:
        """A consumer agent is gone (closed, or NIXL says disconnected): it reads nothing any more."""
        ended = []
        for hold in list(self._holds.values()):
            if hold.state is HoldState.ABORTING and agent in hold.awaiting_acks:
                if self.ack(hold.request_id, hold.nonce, agent) is Heard.ENDED:
                    ended.append(hold)
        return ended

    def claimed_by(self, agent: str) -> list[Hold]:
        """HELD requests whose claim ``agent`` made and whose consumer rank has not reported yet."""
        return [hold for hold in self._holds.values() if hold.state is HoldState.HELD and any(
            a == agent and rank not in hold.heard for rank, a in hold.claimed.items())]

    def watched_agents(self) -> set[str]:
        """Consumer agents a hold waits for: an unreported confirmed claim, or an unacknowledged revocation."""
        out: set[str] = set()
        for hold in self._holds.values():
            if hold.state is HoldState.HELD:
                out.update(a for rank, a in hold.claimed.items() if rank not in hold.heard)
            else:
                out.update(hold.awaiting_acks)
        return out

    # ---- what the embedder and the clock say ----------------------------------------------
    def abort(self, hold: Hold, readers: Iterable[str]) -> bool:
        """Abort a held request; ``readers``: consumer agents that may be reading it. True: ended at once.

        Raises:
            RequestStateError: the hold is already aborting.
        """
        if hold.state is not HoldState.HELD:
            raise RequestStateError("is already being aborted", request_id=hold.request_id, state=hold.state.value)
        self._revoke(hold)
        hold.awaiting_acks = set(readers)
        if not hold.awaiting_acks:
            self._end(hold, HoldState.ABORTED)
            return True
        transition(hold, HoldState.ABORTING, self._clock())
        return False

    def expire(self) -> list[Hold]:
        """End every hold whose lease ran out (EXPIRED, or ABORTED when aborting); revoke their tickets."""
        now = self._clock()
        self._prune_revocations(now)
        ended = []
        for request_id in self._leases.pop_expired(now):
            hold = self._holds[request_id]
            if hold.state is HoldState.HELD:
                self._revoke(hold)
                self._end(hold, HoldState.EXPIRED)
            else:
                self._end(hold, HoldState.ABORTED)
            ended.append(hold)
        return ended

    def pop_released(self) -> list[str]:
        """Ended holds whose blocks' step fences have passed: unpin them; their request ids, in end order."""
        if not self._releasing:
            return []
        out, keep = [], []
        for hold in self._releasing:
            if self.fences.is_clear(b for group in hold.block_ids for b in group):
                self._unpin(hold)
                out.append(hold.request_id)
            else:
                keep.append(hold)
        self._releasing = keep
        return out

    def revocations(self) -> list[tuple[str, int]]:
        """(request id, nonce) of tickets revoked within the last lease."""
        self._prune_revocations(self._clock())
        return list(self._revoked)

    def _prune_revocations(self, now: float) -> None:
        while self._revoked:
            key, until = next(iter(self._revoked.items()))
            if until > now:
                break
            del self._revoked[key]

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_held_requests(self) -> int:
        """Holds not ended yet (HELD or ABORTING)."""
        return len(self._holds)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks pinned by a hold, ended ones waiting for their fences included."""
        return len(self._pins)

    @property
    def num_releasing(self) -> int:
        return len(self._releasing)

    def held_ids(self) -> Sequence[str]:
        return list(self._holds)

    def drop_all(self) -> None:
        """Forget everything (the producer closes; its memory is deregistered)."""
        self._holds.clear()
        self._pins.clear()
        self._releasing.clear()

    # ---- internals ----------------------------------------------------------------------
    def _revoke(self, hold: Hold) -> None:
        self._revoked[(hold.request_id, hold.nonce)] = self._clock() + self.lease_s

    def _end(self, hold: Hold, state: HoldState) -> None:
        transition(hold, state, self._clock())
        del self._holds[hold.request_id]
        self._leases.drop(hold.request_id)
        hold.awaiting_acks = set()
        self._releasing.append(hold)
        self.terminal_counts[state.value] += 1
        self.ended.add(hold.request_id, hold.nonce)

    def _unpin(self, hold: Hold) -> None:
        for group in hold.block_ids:
            for b in group:
                left = self._pins[b] - 1
                if left:
                    self._pins[b] = left
                else:
                    del self._pins[b]
