#!/usr/bin/env bash
# One DEP2 prefill endpoint of several on one host (docs/dep.md): data parallel 2 x attention TP 1,
# expert parallel. ENDPOINT=k (0, 1, ...) takes GPUs 2k and 2k+1, API port 8100+k and side-channel
# base 5600+2k: its two engine cores (engine ids ..._dp0, ..._dp1) listen on base and base+1, so
# endpoints on one host never share a port. Every rank binds every interface and advertises
# PREFILL_ADVERTISE_HOST, an address of this host that the decode hosts reach.
set -euo pipefail
source "$(dirname "$0")/env.sh"
: "${MODEL:?set MODEL to a Qwen3.5 / Qwen3-Next (hybrid GDN) checkpoint}"
: "${PREFILL_ADVERTISE_HOST:?set PREFILL_ADVERTISE_HOST to an address of this host on the transfer network}"
export PREFILL_ADVERTISE_HOST
ENDPOINT=${ENDPOINT:-0}
DP=2
TP=1
BASE=$((5600 + ENDPOINT * DP * TP))
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$((2 * ENDPOINT)),$((2 * ENDPOINT + 1))} exec vllm serve "$MODEL" \
  --port $((8100 + ENDPOINT)) --data-parallel-size $DP --tensor-parallel-size $TP --enable-expert-parallel \
  --no-enable-prefix-caching --async-scheduling --mamba-ssm-cache-dtype bfloat16 \
  --max-num-batched-tokens 16384 \
  --kv-transfer-config "{\"kv_connector\": \"HybridNixlConnector\",
    \"kv_connector_module_path\": \"hybrid_transfer.integrations.vllm\", \"kv_role\": \"kv_producer\",
    \"engine_id\": \"prefill-$(hostname -s)-$ENDPOINT\",
    \"kv_connector_extra_config\": {\"side_channel_host\": \"0.0.0.0\",
      \"advertise_host\": \"env:PREFILL_ADVERTISE_HOST\", \"side_channel_port\": $BASE}}"
