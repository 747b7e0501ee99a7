#!/usr/bin/env bash
# The DEP8 decode endpoint on one 8-GPU host (docs/dep.md): data parallel 8 x attention TP 1, expert
# parallel, OpenAI API on port 8200. kv_consumer: its ranks bind no side channel, they connect out to
# the prefill ranks a ticket names, and only to those in PREFILL_ALLOWED (the connector's default is
# loopback only): prefill hosts or CIDRs with their side-channel ports.
set -euo pipefail
source "$(dirname "$0")/env.sh"
: "${MODEL:?set MODEL to the same checkpoint as the prefill endpoints}"
PREFILL_ALLOWED=${PREFILL_ALLOWED:-127.0.0.1:5600-5607}  # e.g. 10.1.2.0/24:5600-5607
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3,4,5,6,7} exec vllm serve "$MODEL" \
  --port 8200 --data-parallel-size 8 --tensor-parallel-size 1 --enable-expert-parallel \
  --no-enable-prefix-caching --async-scheduling --mamba-ssm-cache-dtype bfloat16 \
  --kv-transfer-config "{\"kv_connector\": \"HybridNixlConnector\",
    \"kv_connector_module_path\": \"hybrid_transfer.integrations.vllm\", \"kv_role\": \"kv_consumer\",
    \"kv_load_failure_policy\": \"recompute\",
    \"kv_connector_extra_config\": {\"allowed_producers\": [\"$PREFILL_ALLOWED\"]}}"
