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


def test_the_embedding_api_is_importable_from_the_package():
    """issue 21 row 5: docs/embedding.md's names were importable only from hybrid_transfer.engine."""
    from hybrid_transfer import engine
    from hybrid_transfer.layout import engine_spec

    for name in ("EngineCard", "RankCard", "issue_ticket", "encode_rank_card", "decode_rank_card", "ticket_to_params",
                 "ticket_from_params", "encode_ticket", "decode_ticket", "ReadState", "FailureCause", "ReadResult"):
        assert getattr(hybrid_transfer, name) is getattr(engine, name), name
    for name in ("EngineRankSpec", "EngineAttentionSpec", "EngineStateSpec", "geometry_from_engine_spec",
                 "EngineGroup", "engine_group_order", "to_our_group_order", "to_engine_group_order"):
        assert getattr(hybrid_transfer, name) is getattr(engine_spec, name), name
    from hybrid_transfer import cache_slots

    assert hybrid_transfer.carve_slots is cache_slots.carve_slots
    assert hybrid_transfer.slots_from_layer_views is cache_slots.slots_from_layer_views


def test_importing_the_package_loads_no_torch_nixl_or_zeromq():
    import subprocess
    import sys

    probe = "import sys, hybrid_transfer; print(sorted(m for m in ('torch', 'nixl', 'zmq') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


def _imported_roots(path):
    """Top-level module names a source file imports (statements and ``importlib.import_module("...")`` literals)."""
    import ast

    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def test_nixl_and_zeromq_are_imported_only_in_engine_and_vllm_only_in_integrations():
    """docs/index.md#code-layers: engine/ alone imports NIXL and ZeroMQ, integrations/ alone vLLM."""
    from pathlib import Path

    import hybrid_transfer

    package = Path(hybrid_transfer.__file__).parent
    crossings = []
    for path in sorted(package.rglob("*.py")):
        part = path.relative_to(package).parts[0]
        roots = _imported_roots(path)
        if part != "engine":
            crossings += [f"{path.relative_to(package)}: {r}" for r in roots
                          if r == "zmq" or r == "nixl" or r.startswith(("nixl_", "nixl-"))]
        if part != "integrations":
            crossings += [f"{path.relative_to(package)}: {r}" for r in roots if r == "vllm"]
    assert crossings == []
