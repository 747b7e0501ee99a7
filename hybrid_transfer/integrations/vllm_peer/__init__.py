"""``--peer vllm-nixl``: vLLM 0.33's own NixlConnector measured beside ours, same caches and requests.

Imports vLLM (integrations/ alone may). Modules: model (one engine's vLLM config and KVCacheConfig
for a preset, from vLLM's planner), engine (vLLM's Scheduler + a worker connector + caches, one
step loop, the hooks timed), bytes_check (a request's valid bytes in vLLM's views), decode_host
(the decode engine's process), pipe (a process commanded through a pipe), side_by_side (the run and
its table). docs/benchmarks.md#vllm-nixl.
"""

from hybrid_transfer.integrations.vllm_peer.side_by_side import (
    ConnectorResult,
    PeerSpec,
    plain_table,
    run_side_by_side,
    same_requests,
    to_json,
)

__all__ = ["ConnectorResult", "PeerSpec", "plain_table", "run_side_by_side", "same_requests", "to_json"]
