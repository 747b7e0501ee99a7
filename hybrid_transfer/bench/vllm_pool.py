"""Block ids as vLLM 0.33's shared block pool hands them out under a churn of requests (--allocation vllm-pool).

What vLLM 0.33.0 does without prefix caching (the only state mode this library supports), read from
v1/core/block_pool.py, kv_cache_utils.py (FreeKVCacheBlockQueue), kv_cache_coordinator.py and
single_type_kv_cache_manager.py:

- One ``BlockPool`` for every KV cache group. Its free queue starts as ids 0 .. N-1 in order, and id 0
  is popped at once as the null block, so requests get ids from 1.
- ``allocate_slots`` asks each group's manager in the KVCacheConfig's group order; each pops its new
  blocks from the head of the queue: ceil(tokens / block_size) for an attention group, one for a GDN
  group (vLLM gives a Mamba group block_size = max_model_len, so a prompt of at most that length needs
  one block). vLLM orders the kinds as the model's layers first show them (kv_cache_planning.py,
  ``_get_kv_cache_groups_uniform_page_size``): GDN, GDN, GDN, attention for every Qwen3.5 preset, where
  ours put attention first (``vllm_group_order`` maps one onto the other).
- ``free`` walks the groups in the same order; each group's blocks go back last-first, and blocks
  without a prefix-cache hash go to the FRONT of the queue (``BlockPool.free_blocks`` prepends them:
  "LIFO reuse of non-cached blocks"), not to its tail as issue 20 describes (the trace test tells the two apart).

The churn (``churn_trace``): requests of 0.8-1.0 x the prompt length arrive one at a time into a pool
holding ``live`` requests at most; when it is full, a live request chosen at random finishes first
(transfers and decodes end out of order). After ``turnovers x live`` such arrivals the ``timed`` requests
arrive, each of exactly the prompt length, and stay live. Pure Python/numpy and deterministic in its seed;
prefill and decode pools are simulated independently (their own block sizes and seeds).
tests/vllm/test_vllm_pool_trace.py replays the same trace through vLLM's real KVCacheManager.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import LayerKind, RankGeometry
from hybrid_transfer.verify import RequestLayout

LOW_SHARE = 0.8  # churn prompts draw from [0.8, 1.0] x the prompt length (the deployment's benchmark)
LIVE_PER_TIMED = 2  # the bench's pool holds twice its timed requests: as many churn requests live beside them
TURNOVERS = 4  # churn arrivals before the timed ones, in multiples of the live requests


@dataclass(frozen=True)
class Arrive:
    """Request ``request`` arrives with a prompt of ``tokens`` tokens and gets its blocks."""

    request: int
    tokens: int


@dataclass(frozen=True)
class Finish:
    """Request ``request`` finishes and frees its blocks."""

    request: int


Event = Arrive | Finish


@dataclass(frozen=True)
class Churn:
    """The workload of one pool: see the module docstring."""

    tokens: int  # the prompt length: churn requests draw LOW_SHARE..1 x it, timed requests exactly it
    timed: int  # the last arrivals, never finished: the requests a bench run moves
    live: int  # requests live at once (the pool's concurrency)
    turnovers: int = TURNOVERS

    def validate(self) -> Churn:
        for name in ("tokens", "timed", "live"):
            if getattr(self, name) < 1:
                raise ConfigError(f"vllm-pool {name}={getattr(self, name)} must be >= 1", field=name,
                                  value=getattr(self, name))
        if self.turnovers < 0:
            raise ConfigError(f"vllm-pool turnovers={self.turnovers} must be >= 0", field="turnovers",
                              value=self.turnovers)
        if self.live < self.timed:
            raise ConfigError(f"vllm-pool live={self.live} must be >= timed={self.timed} (the timed requests are "
                              "live together)", field="live", value=self.live)
        return self

    @property
    def timed_ids(self) -> range:
        first = self.turnovers * self.live
        return range(first, first + self.timed)


def churn_trace(churn: Churn, seed: int) -> tuple[Event, ...]:
    """Arrivals and finishes in order, deterministic in ``seed``; the timed requests arrive last."""
    churn.validate()
    rng = np.random.default_rng(seed)
    low = math.ceil(LOW_SHARE * churn.tokens)
    events: list[Event] = []
    live: list[int] = []  # arrival order; the timed ones are never picked to finish
    first_timed = churn.timed_ids.start
    for request in range(churn.timed_ids.stop):
        if len(live) == churn.live:
            candidates = [r for r in live if r < first_timed]
            victim = candidates[int(rng.integers(len(candidates)))]
            live.remove(victim)
            events.append(Finish(victim))
        timed = request >= first_timed
        tokens = churn.tokens if timed else int(rng.integers(low, churn.tokens + 1))
        events.append(Arrive(request, tokens))
        live.append(request)
    return tuple(events)


def blocks_for(group_block_sizes: Sequence[int | None], tokens: int) -> list[int]:
    """New blocks per group for a prompt of ``tokens``: ceil(tokens / B) per attention group, one per
    state group (``None``), none for an empty prompt."""
    return [-(-tokens // b) if b is not None else int(tokens > 0) for b in group_block_sizes]


def pool_size(group_block_sizes: Sequence[int | None], tokens: int, live: int) -> int:
    """Blocks of a pool that holds ``live`` requests of ``tokens`` tokens at once, plus vLLM's null block 0."""
    return 1 + live * sum(blocks_for(group_block_sizes, tokens))


class BlockPoolSim:
    """vLLM 0.33's free queue and per-request block lists (see the module docstring), nothing else."""

    def __init__(self, num_blocks: int, group_block_sizes: Sequence[int | None]):
        if num_blocks < 2:
            raise ConfigError(f"vllm-pool num_blocks={num_blocks} must be >= 2 (block 0 is vLLM's null block)",
                              field="num_blocks", value=num_blocks)
        self.group_block_sizes = tuple(group_block_sizes)
        self.num_blocks = num_blocks
        self.free_queue: collections.deque[int] = collections.deque(range(1, num_blocks))  # 0: the null block
        self.owned: dict[int, list[list[int]]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, request: int, tokens: int) -> list[list[int]]:
        """Pop the request's blocks group by group from the head; ConfigError when the pool is short."""
        if request in self.owned:
            raise ConfigError(f"vllm-pool request {request} already holds blocks", field="request", value=request)
        counts = blocks_for(self.group_block_sizes, tokens)
        if sum(counts) > self.num_free:
            raise ConfigError(f"vllm-pool request {request} of {tokens} tokens needs {sum(counts)} blocks, "
                              f"{self.num_free} of {self.num_blocks} are free", field="num_blocks",
                              value=self.num_blocks)
        q = self.free_queue
        ids = [[q.popleft() for _ in range(n)] for n in counts]
        self.owned[request] = ids
        return ids

    def free(self, request: int) -> None:
        """Group by group, each group's blocks last-first to the front of the queue."""
        ids = self.owned.pop(request, None)
        if ids is None:
            raise ConfigError(f"vllm-pool request {request} holds no blocks", field="request", value=request)
        for group in ids:
            # prepend_n(reversed(group)): the group's last block ends up at the head.
            self.free_queue.extendleft(group)


def replay(events: Sequence[Event], num_blocks: int,
           group_block_sizes: Sequence[int | None]) -> dict[int, list[list[int]]]:
    """Every request's block ids per group as the pool gave them at its arrival."""
    pool = BlockPoolSim(num_blocks, group_block_sizes)
    out: dict[int, list[list[int]]] = {}
    for ev in events:
        if isinstance(ev, Arrive):
            out[ev.request] = pool.allocate(ev.request, ev.tokens)
        else:
            pool.free(ev.request)
    return out


def vllm_group_order(geometry: RankGeometry) -> tuple[int, ...]:
    """Our group indices (tensor_map order) in vLLM 0.33's order: kinds in the order the model's layers first
    show them, each kind's groups in our order (both split a kind's layers as layers[i::num_groups])."""
    kinds = geometry.model.layer_kinds
    groups = geometry.tensor_map.groups
    return tuple(sorted(range(len(groups)), key=lambda i: (kinds.index(groups[i].kind), i)))


def group_block_sizes(geometry: RankGeometry) -> tuple[int | None, ...]:
    """Groups in vLLM's order: the logical block size of an attention group, None for a GDN group."""
    groups = geometry.tensor_map.groups
    return tuple(geometry.block_size if groups[i].kind is LayerKind.ATTENTION else None
                 for i in vllm_group_order(geometry))


def bench_pool_blocks(geometry: RankGeometry, tokens: int, requests: int) -> int:
    """The bench cache's blocks under vllm-pool: LIVE_PER_TIMED x ``requests`` live requests of ``tokens``."""
    return pool_size(group_block_sizes(geometry), tokens, LIVE_PER_TIMED * requests)


def pool_layouts(geometry: RankGeometry, tokens: int, requests: int, num_blocks: int,
                 seed: int) -> list[RequestLayout]:
    """The ``requests`` timed requests of one side, after a churn in a pool of ``num_blocks`` blocks."""
    churn = Churn(tokens=tokens, timed=requests, live=LIVE_PER_TIMED * requests)
    ids = replay(churn_trace(churn, seed), num_blocks, group_block_sizes(geometry))
    where = {ours: k for k, ours in enumerate(vllm_group_order(geometry))}  # our group -> its place in vLLM's
    return [RequestLayout(block_ids=tuple(tuple(ids[r][where[i]]) for i in range(len(where))), num_tokens=tokens)
            for r in churn.timed_ids]
