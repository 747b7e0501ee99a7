"""Which producer ranks a consumer rank reads from and notifies (docs/lifecycle.md#who-notifies-whom)."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_transfer.errors import TopologyError
from hybrid_transfer.plan.types import Notification


@dataclass(frozen=True)
class Topology:
    """Prefill TP, decode TP and one decode rank: its candidate sources and its notifications.

    Fan-out (decode TP >= prefill TP, r = D/P): the single source d // r, whose
    producer rank waits for r consumers. Fan-in (a = P/D): sources d*a .. d*a+a-1,
    each waiting for one consumer, notified even when none of its bytes are needed.
    """

    prefill_tp: int
    decode_tp: int
    decode_rank: int

    def __post_init__(self) -> None:
        p, d = self.prefill_tp, self.decode_tp
        if p <= 0 or d <= 0 or (p % d and d % p):
            raise TopologyError("one TP size must divide the other", prefill_tp=p, decode_tp=d)
        if not 0 <= self.decode_rank < d:
            raise TopologyError(f"decode rank {self.decode_rank} is outside [0, {d})", prefill_tp=p, decode_tp=d,
                                decode_rank=self.decode_rank)

    @property
    def is_fan_in(self) -> bool:
        return self.prefill_tp > self.decode_tp

    @property
    def sources(self) -> tuple[int, ...]:
        """Producer ranks this consumer may read from, ascending."""
        p, d, rank = self.prefill_tp, self.decode_tp, self.decode_rank
        if self.is_fan_in:
            a = p // d
            return tuple(range(rank * a, rank * a + a))
        return (rank // (d // p),)

    @property
    def notify(self) -> tuple[Notification, ...]:
        expected = 1 if self.is_fan_in else self.decode_tp // self.prefill_tp
        return tuple(Notification(source_rank=s, expected_consumers=expected) for s in self.sources)
