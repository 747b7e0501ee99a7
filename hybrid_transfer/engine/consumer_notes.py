"""A consumer rank's NIXL notifications to and from producer agents (the Consumer's half that speaks them).

Hello to each producer agent of a ready link (reads wait for its Welcome), then every message it sends
back: Welcome (revoked tickets, whether it stages), Staged (pack mode), ClaimReply and ClaimReplies
(engine/claims.py, batched per step by engine/read_batch.py), Revoke (acknowledged at once). With a
shared secret every notification both ways is sealed under the link key (engine/auth.py); one that
fails the check is counted and dropped. Heartbeats renew the leases of waiting and reading requests.
Producer agents NIXL reports disconnected are marked GONE here. Runs on the consumer's owner thread.
"""

from __future__ import annotations

import logging

from hybrid_transfer.engine import auth, wire
from hybrid_transfer.engine.lifecycle.state import FailureCause, ReadState
from hybrid_transfer.engine.peer_record import PeerRecord, PeerStage, advance
from hybrid_transfer.engine.peers import EngineLink, LinkState
from hybrid_transfer.errors import (
    EngineError,
    PeerDisconnectedError,
    TicketClaimError,
    TicketRevokedError,
    WireDecodeError,
)

log = logging.getLogger("hybrid_transfer.engine.consumer")
_LIVE = (ReadState.WAITING_PEER, ReadState.READING)


class ProducerNotes:
    """Mixed into Consumer: its notifications to and from producer agents (uses the Consumer's fields)."""

    def _send_body(self, peer: str, body: wire.Body) -> bool:
        return self._send(peer, wire.encode(body, self._digest))

    def _send(self, peer: str, message: bytes) -> bool:
        """One notification, sealed under the peer's link when a secret is set; False when it failed (a
        disconnected agent is then marked lost)."""
        record = self._records.get(peer)
        if record is not None and record.link is not None:
            counter, mac = record.link.seal(message)
            message = wire.encode(wire.Sealed(counter=counter, mac=mac, message=message), self._digest)
        try:
            self.agent.send_notif(peer, message)
            return True
        except PeerDisconnectedError as exc:
            self._lose(peer, exc)
        except EngineError as exc:
            log.warning("consumer %s: %s", self.agent.name, exc)
        return False

    def _greet(self, link: EngineLink) -> bool:
        """Say Hello once to each producer agent of a ready link; True once every one has welcomed us."""
        welcomed = True
        for agent in link.agents.values():
            record = self._records[agent]
            if record.stage is PeerStage.HANDSHAKEN:
                advance(record, PeerStage.GREETED, self._clock())
                if self._send(agent, wire.encode(wire.Hello(consumer_rank=self.tp_rank,
                                                            agent_metadata=self._metadata), self._digest)):
                    self.stats.hellos_sent += 1
            welcomed = welcomed and record.stage is PeerStage.WELCOMED
        return welcomed

    def _take_notifications(self) -> None:
        self._inbox.put(self.agent.get_notifs())
        self.stats.notifications_dropped = self._inbox.num_dropped
        for sender, message in self._inbox.take():
            self._on_notification(sender, message)

    def _on_notification(self, sender: str, message: bytes) -> None:
        record = self._records.get(sender)
        try:
            env = wire.decode_envelope(message)
            if env.fingerprint != self._digest or record is None or record.stage not in (
                    PeerStage.GREETED, PeerStage.WELCOMED):
                self.stats.unexpected_notifications += 1
                return
            if record.link is not None:
                env = self._unseal(sender, env, record)
                if env is None:
                    return
            elif env.kind is wire.Kind.SEALED:
                raise WireDecodeError("a sealed notification, but this consumer has no secret")
            body = wire.decode_body(env)
        except WireDecodeError:
            self.stats.unexpected_notifications += 1
            return
        now = self._clock()
        if isinstance(body, wire.Welcome):
            self.stats.welcomes += 1
            for ref in body.revoked:
                self._revoke(ref, sender, now + body.lease_s)
            if record.stage is PeerStage.GREETED:
                advance(record, PeerStage.WELCOMED, now)
            self._pack.on_welcome(sender, body.stages)
        elif isinstance(body, wire.Staged):  # pack: where the producer rank staged a request (engine/pack/)
            self._pack.on_staged(sender, body)
        elif isinstance(body, wire.ClaimReply):
            self._on_claim_reply(sender, body.request, body.consumer_rank, body.status, now)
        elif isinstance(body, wire.ClaimReplies):  # batched (read_batch.py): one verdict per request
            for verdict in body.verdicts:
                self._on_claim_reply(sender, verdict.request, body.consumer_rank, verdict.status, now)
        elif isinstance(body, wire.Revoke):
            self.stats.revokes += 1
            self._revoke(body.request, sender, now + body.lease_s)
            self._flush()  # the FAILED completion before the ack, as per_request sends them (the ack ends the hold)
            self._send(sender, wire.encode(wire.RevokeAck(request=body.request), self._digest))
        else:
            self.stats.unexpected_notifications += 1

    def _unseal(self, sender: str, env: wire.Envelope, record: PeerRecord) -> wire.Envelope | None:
        """The inner envelope of a sealed notification that passes its link's check; None when rejected.

        Raises:
            WireDecodeError: a sealed message (or its inner envelope) that does not decode.
        """
        if env.kind is not wire.Kind.SEALED:
            cause = "unsealed"
        else:
            sealed = wire.decode_body(env)
            try:
                record.link.check(sealed.counter, sealed.mac, sealed.message)
            except auth.Rejected as exc:
                cause = exc.cause
            else:
                inner = wire.decode_envelope(sealed.message)
                if inner.fingerprint != self._digest or inner.kind is wire.Kind.SEALED:
                    raise WireDecodeError("a sealed notification whose inner message is not ours")
                return inner
        self.stats.rejected += 1
        self.rejections.add(cause, sender)
        return None

    def _on_claim_reply(self, sender: str, ref: wire.RequestRef, rank: int, status: wire.ClaimStatus,
                        now: float) -> None:
        req = self._requests.get(ref.request_id)
        if req is None or req.ticket.nonce != ref.nonce or sender not in req.awaiting_claims or rank != self.tp_rank:
            self.stats.unexpected_notifications += 1
            return
        req.awaiting_claims.discard(sender)
        if status is wire.ClaimStatus.CONFIRMED:
            self.stats.claims_confirmed += 1
            return
        self.stats.claims_refused += 1
        req.disowned = status is not wire.ClaimStatus.REVOKED  # a revocation is acknowledged as usual
        cause = {wire.ClaimStatus.EDITED: FailureCause.TICKET_EDITED,
                 wire.ClaimStatus.REVOKED: FailureCause.REVOKED}.get(status, FailureCause.TICKET_REPLAYED)
        if req.state in _LIVE:
            self._end(req, TicketClaimError(request_id=req.request_id, nonce=req.ticket.nonce,
                                            status=status.name.lower(), agent=sender), now, cause)

    def _revoke(self, ref: wire.RequestRef, agent: str, until: float) -> None:
        """Remember a revoked ticket; a request reading it fails (it must never be reported DONE)."""
        self._tombstones.add(ref.request_id, ref.nonce, until)
        req = self._requests.get(ref.request_id)
        if req is not None and req.ticket.nonce == ref.nonce and req.state in _LIVE:
            self._end(req, TicketRevokedError(request_id=ref.request_id, nonce=ref.nonce, agent=agent), self._clock(),
                      FailureCause.REVOKED)

    def _heartbeat(self, now: float) -> None:
        """Every heartbeat interval: one Heartbeat per producer agent, naming each request waiting or reading."""
        if now < self._next_heartbeat_at:
            return
        self._next_heartbeat_at = now + self.config.heartbeat_every_s
        per_agent: dict[str, list[wire.RequestRef]] = {}
        for req in self._requests.values():
            link = req.link.resolve()
            if req.state in _LIVE and link.state is LinkState.READY:
                ref = wire.RequestRef(req.request_id, req.ticket.nonce)
                for agent in link.agents.values():
                    per_agent.setdefault(agent, []).append(ref)
        for agent, refs in per_agent.items():
            if self._is_lost(agent):
                continue
            message = wire.encode(wire.Heartbeat(consumer_rank=self.tp_rank, requests=tuple(refs)), self._digest)
            if self._send(agent, message):
                self.stats.heartbeats_sent += 1
            else:
                self.stats.heartbeat_failures += 1

    def _links_in_use(self) -> set[EngineLink]:
        """Links a request (active, or ended and not yet reported) or a pending decline still needs."""
        used = {req.link.resolve() for req in self._requests.values()}
        return used | self._declines.links()

    def _drop_link(self, link: EngineLink) -> None:
        """An idle ready link goes (Peers evicted or replaced it): Bye to each producer agent we greeted (it
        forgets us), and the agents leave NIXL at the next poll, once the Byes are out."""
        sent, failed = self._outbox.flush(self._send_body, self.tp_rank)  # nothing of ours may follow the Bye
        self.stats.notifications_sent += sent
        self.stats.notify_failures += failed
        bye = wire.encode(wire.Bye(consumer_rank=self.tp_rank), self._digest)
        for agent in link.agents.values():
            record = self._records.get(agent)
            if record is not None and record.stage in (PeerStage.GREETED, PeerStage.WELCOMED):
                self._send(agent, bye)
            self._unloaded.append(agent)

    def _unload(self) -> None:
        """Remove from NIXL the producer agents of dropped links (unless linked again since)."""
        unloaded, self._unloaded = self._unloaded, []
        for agent in unloaded:
            if agent not in self._records:
                self._pack.forget_agent(agent)
                try:
                    self.agent.remove_remote(agent)
                except EngineError as exc:
                    log.info("consumer %s: %s", self.agent.name, exc)

    def _lose(self, agent: str, error: BaseException) -> None:
        record = self._records.get(agent)
        if record is None:
            return  # not an agent of a link we hold (its link was dropped idle): nothing depends on it
        self.reads.invalidate(agent, f"the producer agent is gone: {error}")  # no mapped copy from it after this
        if record.stage is not PeerStage.GONE:
            advance(record, PeerStage.GONE, self._clock())
            record.error = error
            log.warning("consumer %s: producer agent %s is gone: %s", self.agent.name, agent, error)

    def _is_lost(self, agent: str) -> bool:
        record = self._records.get(agent)
        return record is not None and record.stage is PeerStage.GONE

    def _lost_agent(self, link: EngineLink) -> str | None:
        return next((a for a in link.agents.values() if self._is_lost(a)), None)
