"""A test subclass of the connector that corrupts loads on purpose: the negative controls of the parity suite.

Loaded by vLLM from ``kv_connector_module_path: "faulty_connector"`` (never a production flag). The
environment variable ``HT_TEST_FAULTS`` lists ``fault@num_tokens`` entries: a finished load of a request
whose ticket carries that many tokens (the prompt's N-1) gets the fault, every other load lands as it is:

- ``zero_state``: the request's GDN state pages are zeroed after its read finished;
- ``skip_block``: its first attention block is zeroed, as if that block had not been read;
- ``other_state``: its state pages get the state of the load before it;
- ``whole_prompt`` (prefix caching): the read ignores the request's local hit and moves the whole prompt,
  the hit's blocks included (same bytes over them): only the byte count can tell;
- ``hit_state`` (prefix caching): its state pages get the state cached at the hit's position (the state
  after the hit's tokens instead of after N-1: a state from the wrong position);

Each fault runs where the worker zeroes a finished read's unwritten tail, so the request then
finishes normally: only the parity criterion can tell.
"""

from __future__ import annotations

import dataclasses
import os

from hybrid_transfer.integrations.vllm.connector import HybridNixlConnector
from hybrid_transfer.integrations.vllm.metadata import ReadOrder
from hybrid_transfer.integrations.vllm.scheduler import SchedulerSide
from hybrid_transfer.integrations.vllm.worker import WorkerSide


def _faults() -> dict[int, str]:
    faults = {}
    for entry in filter(None, os.environ.get("HT_TEST_FAULTS", "").split(",")):
        fault, tokens = entry.split("@")
        faults[int(tokens)] = fault
    return faults


@dataclasses.dataclass(frozen=True)
class HitStateOrder(ReadOrder):
    """A read order that also names, per state group, the block holding the state at the hit's position."""

    hit_state_block_ids: tuple[int, ...] = ()


class FaultySchedulerSide(SchedulerSide):
    faults = _faults()

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        order = self._reads.get(request.request_id)
        if order is None or self.faults.get(order.ticket.num_tokens) != "hit_state" or not order.first_token:
            return
        every = self.group_map.to_ours(self.kv_cache_config.select_transfer_block_ids(blocks.get_block_ids()))
        at = order.first_token // self.block_size - 1  # align mode: the state after first_token tokens
        hit = tuple(ids[at] for ids, attn in zip(every, self.group_map.attention_mask, strict=True) if not attn)
        self._reads[request.request_id] = HitStateOrder(order.ticket, order.local_block_ids,
                                                        order.expected_state_position, order.first_token, hit)


class FaultyWorkerSide(WorkerSide):
    faults = _faults()
    previous_state: list | None = None  # the state pages of the last load, as they landed

    def _read_all(self, reads) -> None:
        reads = {rid: dataclasses.replace(order, first_token=0)
                 if self.faults.get(order.ticket.num_tokens) == "whole_prompt" else order
                 for rid, order in reads.items()}
        super()._read_all(reads)

    def _hit_state_pages(self, order):
        g = self.engine.cache.geometry
        state_groups = [i for i, attn in enumerate(self.engine.group_map.attention_mask) if not attn]
        for group_index, block in zip(state_groups, order.hit_state_block_ids, strict=True):
            for layer in g.tensor_map.groups[group_index].layers:
                yield self.engine.cache.raw(g.tensor_of(layer))[block]

    def _state_pages(self, order):
        g = self.engine.cache.geometry
        for group_index, is_attention in enumerate(self.engine.group_map.attention_mask):
            if not is_attention:
                block = order.local_block_ids[group_index][0]
                for layer in g.tensor_map.groups[group_index].layers:
                    yield self.engine.cache.raw(g.tensor_of(layer))[block]

    def _zero_tail(self, order) -> None:
        super()._zero_tail(order)
        fault = self.faults.get(order.ticket.num_tokens, "none")
        pages = list(self._state_pages(order))
        snapshot = [p.clone() for p in pages]
        if fault == "zero_state":
            for page in pages:
                page.zero_()
        elif fault == "skip_block":
            g = self.engine.cache.geometry
            for group_index, is_attention in enumerate(self.engine.group_map.attention_mask):
                if is_attention:
                    block = order.local_block_ids[group_index][0]
                    for layer in g.tensor_map.groups[group_index].layers:
                        self.engine.cache.raw(g.tensor_of(layer))[block].zero_()
        elif fault == "other_state":
            if type(self).previous_state is None:
                raise RuntimeError("other_state needs a load before it")
            for page, other in zip(pages, type(self).previous_state, strict=True):
                page.copy_(other)
        elif fault == "hit_state":
            for page, cached in zip(pages, list(self._hit_state_pages(order)), strict=True):
                page.copy_(cached)
        elif fault != "none" and fault != "whole_prompt":
            raise ValueError(f"unknown fault {fault!r}")
        type(self).previous_state = snapshot


class FaultyHybridConnector(HybridNixlConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self, "_scheduler", None) is not None:
            self._scheduler.__class__ = FaultySchedulerSide

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        self._worker.__class__ = FaultyWorkerSide
