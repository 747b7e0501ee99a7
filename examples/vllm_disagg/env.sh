# Environment both engines need; source it in each shell before serve_prefill.sh / serve_decode.sh.

# GDN conv state channels-outer (DS), so a TP slice of it is one byte range; vLLM's default is SD.
# Both sides must agree: the connector's handshake refuses a mismatch.
export VLLM_SSM_CONV_STATE_LAYOUT=DS
# UCX's cuda_ipc transport serves GPU-to-GPU READs only with this set; without it GPU bytes
# silently go over TCP (hybrid-transfer doctor checks it).
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
# No shared secret: hybrid_transfer's side channel and NIXL's transfers are not authenticated.
# Keep the side-channel ports and the NIXL traffic on a trusted network.
