#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint with ruff, build the docs strictly, run the test suite, then the vLLM suite.
#
# The main suite runs in .venv, which has no vLLM: tests/vllm is excluded from it by name. The vLLM
# suite (tests/vllm) runs in the cached vLLM 0.33 environment of scripts/vllm_env.sh (created on
# first use, a few minutes; reused after), with this checkout on PYTHONPATH. Extra arguments go to
# the main suite's pytest. VLLM_SUITE=0 leaves the vLLM suite out, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict  # broken links, anchors or docstrings fail
.venv/bin/python -m pytest -q --ignore=tests/vllm "$@"

if [ "${VLLM_SUITE:-1}" = "0" ]; then
    echo "test.sh: vLLM suite NOT run (VLLM_SUITE=0)" >&2
    exit 0
fi
vllm_env=$(bash scripts/vllm_env.sh)
VLLM_TARGET_DEVICE=cpu VLLM_SSM_CONV_STATE_LAYOUT=DS HF_HUB_OFFLINE=1 \
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$vllm_env/bin/python" -m pytest -q -p no:cacheprovider tests/vllm
