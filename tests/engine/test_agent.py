"""NixlAgent: NIXL failures arrive as EngineError, lifecycle misuse is refused, the delay patch is undone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_transfer.cache import Region
from hybrid_transfer.engine import EngineConfig, ProgressPolicy
from hybrid_transfer.engine.agent import NixlAgent, _nixl_api
from hybrid_transfer.errors import EngineError


@pytest.fixture(scope="module")
def agent():
    a = NixlAgent("test-agent-main", EngineConfig())
    a.buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    a.register([Region(a.buffer.data_ptr(), a.buffer.numel(), 0)])
    yield a
    a.close()


def test_regions_are_registered_once(agent):
    with pytest.raises(EngineError, match="already registered"):
        agent.register([Region(agent.buffer.data_ptr(), 16, 0)])


def test_nixl_errors_are_wrapped_with_the_operation_and_peer(agent):
    with pytest.raises(EngineError) as info:
        agent.add_remote(b"not metadata")
    assert info.value.operation == "add remote agent" and info.value.__cause__ is not None
    descs = np.array([[agent.buffer.data_ptr(), 64, 0]], dtype=np.int64)
    with pytest.raises(EngineError) as info:
        agent.post_read("nobody", descs, descs)
    assert info.value.peer == "nobody"


def test_a_progress_thread_with_a_delay_leaves_the_bindings_as_they_were():
    api = _nixl_api()
    before = api.nixlBind.nixlAgentConfig
    threaded = NixlAgent("test-agent-threaded", EngineConfig(progress=ProgressPolicy.ON_WITH_DELAY,
                                                             progress_delay_us=500))
    try:
        assert api.nixlBind.nixlAgentConfig is before
    finally:
        threaded.close()


def test_a_closed_agent_refuses_every_call():
    a = NixlAgent("test-agent-closed", EngineConfig())
    a.close()
    a.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        _ = a.metadata
    with pytest.raises(EngineError, match="closed"):
        a.get_notifs()


def test_the_ucx_backend_is_created_with_the_configured_thread_pool():
    """split_batch_size reaches UCX only through create_backend: NIXL reports what the backend was built with."""
    a = NixlAgent("test-agent-pool", EngineConfig(num_backend_threads=2, split_batch_size=8))
    try:
        assert a.backend_params == {"num_threads": "2", "split_batch_size": "8"}
        assert a._agent.get_backend_params("UCX") == {"num_threads": "2", "split_batch_size": "8"}
        assert a.backends == ["UCX"]
    finally:
        a.close()
    host = NixlAgent("test-agent-host", EngineConfig())  # host memory by default: no pool
    try:
        assert host.backend_params == {} and host.backends == ["UCX"]
    finally:
        host.close()
