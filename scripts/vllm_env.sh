#!/usr/bin/env bash
# Create (or reuse) the separate environment the vLLM integration tests run in, and print its path.
#
# vLLM 0.33.0 is installed with --no-deps: without it pip pulls a CUDA torch of about 9 GB. The
# light packages below are the ones vLLM's CPU import path needs (docs/vllm.md lists why). The
# environment lives outside the checkout, keyed by the vLLM version, the Python version and this
# script's hash, so a fresh clone reuses it and the main .venv stays vLLM-free. This package is
# not installed into it: the tests put the checkout on PYTHONPATH, so one cached environment
# serves every checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.33.0
python=${PYTHON:-python3}
pyver=$("$python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
key=$(sha256sum "$0" | cut -c1-12)
root=${HYBRID_TRANSFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybrid-transfer}
env="$root/vllm-$VLLM_VERSION-$pyver-$key"
stamp="$env/.complete"

if [ -f "$stamp" ]; then
    echo "$env"
    exit 0
fi

mkdir -p "$root"
# One creator at a time: concurrent test runs on one machine wait for the first to finish.
exec 9>"$root/.lock-vllm-$VLLM_VERSION-$pyver-$key"
flock 9
if [ -f "$stamp" ]; then
    echo "$env"
    exit 0
fi

start=$(date +%s)
echo "vllm_env: creating $env (first run: a few minutes)" >&2
rm -rf "$env"
"$python" -m venv "$env"
pip_install() {
    "$env/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2
}
pip_install torch==2.13.0
pip_install --no-deps "vllm==$VLLM_VERSION"
pip_install packaging numpy msgspec pyzmq pydantic pyyaml psutil regex \
    "transformers>=5.16.1,<5.21.0" cbor2 aiohttp requests openai oss-harmony pillow pybase64 \
    cachetools cloudpickle uvloop py-cpuinfo prometheus_client "fastapi>=0.133.0,<0.137.0" \
    partial_json_parser "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0" "apache-tvm-ffi==0.1.11" \
    einops compressed-tensors==0.17.0 loguru \
    nixl pytest hypothesis
# Compile vLLM's bytecode now, so the first test run does not pay 45-60 s of import time.
"$env/bin/python" -c 'import vllm.distributed.kv_transfer.kv_connector.v1.base' >/dev/null 2>&1 || true
touch "$stamp"
echo "vllm_env: ready in $(( $(date +%s) - start )) s" >&2
echo "$env"
