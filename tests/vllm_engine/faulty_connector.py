"""A test subclass of the connector that corrupts loads on purpose: the negative controls of the parity suite.

Loaded by vLLM from ``kv_connector_module_path: "faulty_connector"`` (never a production flag). The
environment variable ``HT_TEST_FAULTS`` lists ``fault@num_tokens`` entries: a finished load of a request
whose ticket carries that many tokens (the prompt's N-1) gets the fault, every other load lands as it is:

- ``zero_state``: the request's GDN state pages are zeroed after its read finished;
- ``skip_block``: its first attention block is zeroed, as if that block had not been read;
- ``other_state``: its state pages get the state of the load before it;

Each fault runs where the worker zeroes a finished read's unwritten tail, so the request then
finishes normally: only the parity criterion can tell.
"""

from __future__ import annotations

import os

from hybrid_transfer.integrations.vllm.connector import HybridNixlConnector
from hybrid_transfer.integrations.vllm.worker import WorkerSide


def _faults() -> dict[int, str]:
    faults = {}
    for entry in filter(None, os.environ.get("HT_TEST_FAULTS", "").split(",")):
        fault, tokens = entry.split("@")
        faults[int(tokens)] = fault
    return faults


class FaultyWorkerSide(WorkerSide):
    faults = _faults()
    previous_state: list | None = None  # the state pages of the last load, as they landed

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
        elif fault != "none":
            raise ValueError(f"unknown fault {fault!r}")
        type(self).previous_state = snapshot


class FaultyHybridConnector(HybridNixlConnector):
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        self._worker.__class__ = FaultyWorkerSide
