"""The mapped read path over CUDA IPC on one GPU (issue 28): the CPU tests' scenarios with CUDA caches.

NIXL (UCX cuda_ipc) and the mapped path (CUDA IPC handles opened once per link, one gather kernel per
post) move identical verified bytes over both layouts and three TP pairs; abort, revoke, a killed
producer and an incarnation change end as on the NIXL path with no copy once the mapping is invalid;
a consumer without the secret never gets a handle. Every rank is a separate process on GPU 0.
"""

from __future__ import annotations

import pytest
from harness import TINY, RankSpec
from test_mapped import LAYOUTS, PAIRS, identical_bytes_case
from test_mapped_faults import abort_case, incarnation_case, killed_case, no_secret_case, revoke_case

SECRET = b"mapped-cuda-secret-0123456789abcdef"
SPEC = RankSpec(TINY, 1, 0, 16, device="cuda")


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mapped-cuda") / "secret"
    path.write_bytes(SECRET)
    return str(path)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_nixl_and_cuda_ipc_move_identical_verified_bytes(cluster, secret_file, pair, layout):
    identical_bytes_case(cluster, secret_file, pair, layout, "cuda", "cuda_ipc")


def test_an_abort_ends_alike(cluster, secret_file):
    abort_case(cluster, secret_file, SPEC, "cuda_ipc")


def test_a_revoked_ticket_ends_alike(cluster, secret_file):
    revoke_case(cluster, secret_file, SPEC)


def test_a_killed_producer_ends_alike_with_no_copy_after(cluster, secret_file):
    killed_case(cluster, secret_file, SPEC, "cuda_ipc")


def test_a_new_incarnation_invalidates_the_old_mapping(cluster, secret_file):
    incarnation_case(cluster, secret_file, SPEC, "cuda_ipc")


def test_a_consumer_without_the_secret_never_gets_a_handle(cluster, secret_file):
    no_secret_case(cluster, secret_file, SPEC)
