"""The soak's second consumer: an authenticated neighbour that holds the same tickets as the real reader.

It lives in the decode process beside the real Consumer, with its own NIXL agent and the same secret,
so the producer has handshaken it. For live requests the real consumer is reading, it declines the
ticket (with its MAC and with a garbage one), reads it and aborts at once, or reads it to the end;
and it starts reads of hostile ``kv_transfer_params`` (soak/hostile.py). The producer must keep every
hold for the reader whose claim it confirmed (docs/lifecycle.md), hostile params must be refused with
a typed error, and nothing the rival reads may hold wrong bytes (docs/soak.md#rival).
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter

import msgspec

log = logging.getLogger(__name__)
RIVAL_BLOCKS = 512
ACTIONS = ("decline", "decline_bad_mac", "read_abort", "read")


class Rival:
    """One second Consumer and what became of everything it tried (``outcomes``: action/outcome -> count)."""

    def __init__(self, config, geometry):
        from hybrid_transfer.cache import HybridCache
        from hybrid_transfer.engine import Consumer
        from hybrid_transfer.verify import poison

        self.cache = HybridCache.allocate(geometry, RIVAL_BLOCKS)
        poison(self.cache)
        self.engine = Consumer(self.cache, config, engine_id="rival")
        self.free = list(range(RIVAL_BLOCKS))
        self.reading: dict[str, tuple[str, tuple, int | None, int]] = {}  # request id -> (action, local, seed, tokens)
        self.outcomes: Counter = Counter()
        self.wrong_bytes = 0
        self.hostile_done = 0

    def act(self, tickets: list[bytes], seeds: list[int], rng: random.Random, hostile_per_ticket: int) -> None:
        from hybrid_transfer.engine import decode_ticket, ticket_to_params

        for data, seed in zip(tickets, seeds, strict=True):
            ticket = decode_ticket(data)
            action = rng.choice(ACTIONS)
            self._try(action, lambda t=ticket, a=action, sd=seed: self._do(a, t, sd))
            params = ticket_to_params(ticket)
            for _ in range(hostile_per_ticket):
                self._hostile(params, rng)

    def _do(self, action: str, ticket, seed: int) -> str:
        if action.startswith("decline"):
            if action == "decline_bad_mac":
                ticket = msgspec.structs.replace(ticket, mac=bytes(32))
            return "sent" if self.engine.decline(ticket) else "dropped"
        outcome = self._read(action, ticket, ticket.num_tokens, seed)
        if outcome == "started" and action == "read_abort":
            self.engine.abort(ticket.request_id)
        return outcome

    def _read(self, action: str, ticket, room_tokens: int, seed: int | None) -> str:
        """Start reading ``ticket`` into free local blocks for ``room_tokens``; they come back if it is refused."""
        local = self._take(room_tokens)
        if local is None:
            return "no_room"
        try:
            self.engine.start_read(ticket, local, expected_state_position=ticket.num_tokens)
        except BaseException:
            self._give(local)
            raise
        self.reading[ticket.request_id] = (action, local, seed, ticket.num_tokens)
        return "started"

    def _hostile(self, params: dict, rng: random.Random) -> None:
        from hybrid_transfer.engine import ticket_from_params
        from hybrid_transfer.soak.hostile import draw

        field, bad = draw(params, rng)
        if isinstance(bad, dict) and isinstance(bad.get("request_id"), str) and field != "request_id":
            bad["request_id"] = "hostile-" + bad["request_id"]  # a request the rival is not reading already

        def start() -> str:
            ticket = ticket_from_params(bad)
            return self._read(f"params:{field}", ticket, ticket.num_tokens if ticket.num_tokens < 10_000 else 0, None)

        self._try(f"params:{field}", start)

    def _try(self, action: str, attempt) -> None:
        from hybrid_transfer.errors import HybridTransferError

        try:
            outcome = attempt()
        except HybridTransferError as exc:
            outcome = f"refused:{type(exc).__name__}"
        except Exception as exc:  # noqa: BLE001 - an untyped escape is what the soak looks for
            outcome = f"UNTYPED:{type(exc).__name__}"
            log.warning("rival %s: untyped %r", action, exc)
        self.outcomes[f"{action}/{outcome}"] += 1

    def poll(self) -> None:
        for r in self.engine.poll():
            action, local, seed, tokens = self.reading.pop(r.request_id)
            label = r.state.value if r.ok else f"{r.state.value}:{r.cause.value if r.cause else '?'}"
            if r.ok and action.startswith("params:"):
                self.hostile_done += 1
            elif r.ok and seed is not None:
                label += "/verified" if self._holds(local, tokens, seed) else "/WRONG"
            self.outcomes[f"{action}/{label}"] += 1
            self._give(local)

    def _holds(self, local, tokens: int, seed: int) -> bool:
        from hybrid_transfer.soak.worker import blocks_hold
        from hybrid_transfer.verify import RequestLayout

        ok = blocks_hold(self.cache, RequestLayout(local, tokens), seed)
        self.wrong_bytes += not ok
        return ok

    def _take(self, num_tokens: int):
        need = math.ceil(num_tokens / self.cache.geometry.block_size)
        if len(self.free) < need + 3:
            return None
        ids, self.free = self.free[:need + 3], self.free[need + 3:]
        return (tuple(ids[:need]), (ids[need],), (ids[need + 1],), (ids[need + 2],))

    def _give(self, local) -> None:
        from hybrid_transfer.verify import POISON_BYTE

        for t in self.cache.tensors:  # poisoned again, so a late write shows up in a later check
            pages = t.view(self.cache.num_blocks, self.cache.geometry.page_bytes)
            for group in local:
                for b in group:
                    pages[b].fill_(POISON_BYTE)
        self.free.extend(b for group in local for b in group)

    def state(self) -> dict[str, int]:
        e = self.engine
        return {"active": e.num_active, "quarantined": e.num_quarantined_blocks, "handles": e.agent.num_live_handles,
                "wrong_bytes": self.wrong_bytes, "hostile_done": self.hostile_done,
                "untyped": sum(n for k, n in self.outcomes.items() if "/UNTYPED:" in k)}

    def close(self) -> None:
        self.engine.close()
