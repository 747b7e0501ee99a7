"""Engine test fixtures: one session-wide cluster of spawned worker processes (harness.py)."""

from __future__ import annotations

import copy

import pytest
from harness import TINY, Cluster

NUM_WORKERS = 6  # the largest topology under test, 2 -> 4 or 4 -> 2, on separate processes


@pytest.fixture
def tiny() -> dict:
    return copy.deepcopy(TINY)


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(NUM_WORKERS)
    yield c
    c.close()
