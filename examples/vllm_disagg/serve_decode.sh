#!/usr/bin/env bash
# Decode engine: TP1 on GPU 2, OpenAI API on port 8200 (P2 -> D1: each decode rank reads from both
# prefill ranks). kv_both: the same config could serve prefill; its own side channel is on 5700.
set -euo pipefail
source "$(dirname "$0")/env.sh"
: "${MODEL:?set MODEL to the same checkpoint as the prefill engine}"
DECODE_HOST=${DECODE_HOST:-127.0.0.1}
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-2} exec vllm serve "$MODEL" \
  --port 8200 --tensor-parallel-size 1 --no-enable-prefix-caching \
  --kv-transfer-config "{\"kv_connector\": \"HybridNixlConnector\",
    \"kv_connector_module_path\": \"hybrid_transfer.integrations.vllm\", \"kv_role\": \"kv_both\",
    \"kv_connector_extra_config\": {\"side_channel_host\": \"$DECODE_HOST\", \"side_channel_port\": 5700}}"
