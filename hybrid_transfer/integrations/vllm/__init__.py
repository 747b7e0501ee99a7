"""vLLM 0.33 KVConnector plugin: the only code in this package that imports vLLM.

Load it with ``--kv-transfer-config '{"kv_connector": "HybridNixlConnector",
"kv_connector_module_path": "hybrid_transfer.integrations.vllm", "kv_role": "kv_both", ...}'``
(docs/vllm.md). Modules: connector (the class vLLM loads), scheduler and worker (its two halves),
metadata (what they tell each other), params (the kv_transfer_params schema), geometry (our
view of vLLM's live cache), groups (vLLM's group order mapped to ours).
"""

from hybrid_transfer.integrations.vllm.connector import HybridNixlConnector

__all__ = ["HybridNixlConnector"]
