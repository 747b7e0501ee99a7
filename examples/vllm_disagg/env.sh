# Environment both engines need; source it in each shell before serve_prefill.sh / serve_decode.sh.

# GDN conv state channels-outer (DS), so a TP slice of it is one byte range; vLLM's default is SD.
# Both sides must agree: the connector's handshake refuses a mismatch.
export VLLM_SSM_CONV_STATE_LAYOUT=DS
# UCX's cuda_ipc transport serves GPU-to-GPU READs only with this set; without it GPU bytes
# silently go over TCP (hybrid-transfer doctor checks it).
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
# The shared secret (the same on every prefill and decode process): authenticates handshakes and
# notifications and signs tickets (docs/security.md). Read it from a file only the serving user can
# read; never put it in kv_connector_extra_config, which vLLM logs.
: "${HYBRID_TRANSFER_SECRET_FILE:=$HOME/.hybrid-transfer-secret}"
if [ -r "$HYBRID_TRANSFER_SECRET_FILE" ]; then
    HYBRID_TRANSFER_SECRET=$(cat "$HYBRID_TRANSFER_SECRET_FILE")
    export HYBRID_TRANSFER_SECRET
else
    echo "env.sh: no secret at $HYBRID_TRANSFER_SECRET_FILE; the engines will run unauthenticated" >&2
fi
