#!/usr/bin/env bash
# Prefill engine: TP2 on GPUs 0,1, OpenAI API on port 8100. Its TP ranks' side channels listen on
# SIDE_CHANNEL_PORT + rank (5600, 5601) at PREFILL_HOST, which decode ranks must reach.
set -euo pipefail
source "$(dirname "$0")/env.sh"
: "${MODEL:?set MODEL to a Qwen3-Next / Qwen3.5 (hybrid GDN) checkpoint}"
PREFILL_HOST=${PREFILL_HOST:-127.0.0.1}
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} exec vllm serve "$MODEL" \
  --port 8100 --tensor-parallel-size 2 --no-enable-prefix-caching \
  --kv-transfer-config "{\"kv_connector\": \"HybridNixlConnector\",
    \"kv_connector_module_path\": \"hybrid_transfer.integrations.vllm\", \"kv_role\": \"kv_both\",
    \"kv_connector_extra_config\": {\"side_channel_host\": \"$PREFILL_HOST\", \"side_channel_port\": 5600}}"
