"""The vLLM suite: runs only in the cached vLLM environment (scripts/vllm_env.sh; scripts/test.sh runs it).

vLLM reads its platform and conv-state layout from the environment at import, so the defaults
are set before anything imports it. The main .venv has no vLLM: its test run passes
``--ignore=tests/vllm`` (scripts/test.sh); running this directory there fails loudly below.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

for key, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_SSM_CONV_STATE_LAYOUT": "DS", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, str(Path(__file__).parent))

try:
    import vllm.config  # noqa: F401 - the real package (tests/vllm itself would pass for a namespace "vllm")
except ImportError as exc:  # pragma: no cover - the wrong interpreter
    raise RuntimeError("tests/vllm needs vLLM: run it with the interpreter of `bash scripts/vllm_env.sh` "
                       "(scripts/test.sh does)") from exc

import pytest  # noqa: E402
from vllm_engine import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """One local tiny Qwen3-Next config for every engine of the session (same model name on both sides)."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-next")


@pytest.fixture(scope="session")
def hosts():
    """Host processes for the whole session: prefill ranks, decode ranks, and a victim the kill test kills."""
    import multiprocessing as mp

    from rank_host import Host

    ctx = mp.get_context("spawn")
    pair = {name: Host(ctx, f"{name}-host") for name in ("prefill", "decode", "victim")}
    yield pair
    for host in pair.values():
        host.close()  # a killed victim is already gone
