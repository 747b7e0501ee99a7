"""Engine test fixtures: one cluster of worker processes (harness.py) shared by the engine tests.

The cluster starts when the first test asks for it and is closed as soon as the run leaves
tests/engine (or at the end of the session), so its workers do not sit in memory through the rest
of the suite; a later engine test that asks for it again gets a fresh one.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from harness import TINY, Cluster

NUM_WORKERS = 6  # the largest topology under test, 2 -> 4 or 4 -> 2, on separate processes
HERE = Path(__file__).resolve().parent


class SharedCluster:
    """The engine tests' workers: started on first use of ``workers``, stopped by ``close``, started again after."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._cluster: Cluster | None = None

    @property
    def workers(self):
        if self._cluster is None:
            self._cluster = Cluster(self.num_workers)
        return self._cluster.workers

    @property
    def running(self) -> bool:
        return self._cluster is not None

    def close(self) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()


_SHARED = SharedCluster(NUM_WORKERS)


@pytest.fixture
def tiny() -> dict:
    return copy.deepcopy(TINY)


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory) -> str:
    """A shared-secret file for engines that authenticate (the mapped path hands out nothing without one)."""
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_bytes(b"engine-tests-secret-0123456789abcdef")
    return str(path)


@pytest.fixture(scope="session")
def cluster():
    yield _SHARED
    _SHARED.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last engine test in a row (its fixtures torn down), stop the shared workers."""
    yield
    if _SHARED.running and (nextitem is None or HERE not in Path(nextitem.path).resolve().parents):
        _SHARED.close()
