"""Everything the package exports resolves, and the embedder helpers are the library's own functions."""

import hybrid_transfer


def test_every_export_resolves():
    for name in hybrid_transfer.__all__:
        assert getattr(hybrid_transfer, name) is not None, name


def test_embedder_helpers_are_exported_from_their_one_home():
    from hybrid_transfer.engine.agent import quiet_nixl_logging
    from hybrid_transfer.layout.blocks import kernel_block_ids
    from hybrid_transfer.planner_input import describe_cache, memory_space

    assert hybrid_transfer.describe_cache is describe_cache
    assert hybrid_transfer.memory_space is memory_space
    assert hybrid_transfer.kernel_block_ids is kernel_block_ids
    assert hybrid_transfer.quiet_nixl_logging is quiet_nixl_logging
