"""GPU tests (issue 28: the mapped path over CUDA IPC). Not part of the main suite: scripts/test.sh leaves
tests/gpu out by name and says so, because CI has no GPU; run them on a GPU host with
``bash scripts/gpu_run.sh mapped-pytest`` (or ``python -m pytest tests/gpu``). Without CUDA they fail loudly
here instead of skipping.

They reuse the engine tests' process harness (tests/engine/harness.py) and scenarios.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")  # else UCX moves GPU bytes over TCP (docs/tuning.md#cuda-ipc)
ENGINE_TESTS = Path(__file__).resolve().parent.parent / "engine"
sys.path.insert(0, str(ENGINE_TESTS))

from harness import Cluster  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError("tests/gpu needs a CUDA device (torch.cuda is unavailable): run it on a GPU host")


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(6)
    yield c
    c.close()
