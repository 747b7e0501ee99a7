"""The bench's ``--transport``: which path UCX may take between the rank processes (docs/between-hosts.md).

``shm`` leaves UCX alone: on one host it picks shared memory (cma on CPU, cuda_ipc on GPU). ``tcp`` starts
every rank process with UCX limited to TCP on the first non-loopback interface (engine/tcp_path.py): the
path two hosts without RDMA would use, here through the local TCP stack. UCX reads the variables when a
process creates its agent, so they are set in the parent only while it spawns the rank processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

TRANSPORTS = ("shm", "tcp")


def rank_env(transport: str) -> dict[str, str]:
    """The UCX variables of every rank process for ``transport`` ({} for shm).

    Raises:
        ConfigError: tcp on a host with no non-loopback IPv4 interface.
    """
    if transport != "tcp":
        return {}
    from hybrid_transfer.engine.tcp_path import first_network_interface, tcp_only_env

    return tcp_only_env(first_network_interface().name)


@contextmanager
def rank_environment(transport: str) -> Iterator[dict[str, str]]:
    """Within the block, os.environ carries ``rank_env(transport)`` (for processes spawned there); restored after."""
    from hybrid_transfer.engine.tcp_path import environment

    with environment(rank_env(transport)) as env:
        yield env


def describe(transport: str) -> dict[str, str]:
    """What the report records: the transport and the UCX variables it set (or found, for shm)."""
    env = rank_env(transport) or {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ}
    return {"transport": transport, **env}
