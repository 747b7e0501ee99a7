"""The doctor's shape (issue 15): its own package, no import cycle, NIXL only through the engine's agent."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import hybrid_transfer
import hybrid_transfer.doctor as doctor

DOCTOR = Path(doctor.__file__).parent
ENGINE = Path(hybrid_transfer.__file__).parent / "engine"
NIXL_API = re.compile(r"^nixl(_cu\d+|_rocm)?(\.|$)")  # the meta package and its builds (not nixl_meta_utils)
# Methods of NIXL's own Python API and its raw transfer states; the engine's NixlAgent wraps every one.
RAW_CALLS = {"nixl_agent", "nixl_agent_config", "get_new_notifs", "check_xfer_state", "initialize_xfer", "transfer",
             "release_xfer_handle", "add_remote_agent", "register_memory", "get_reg_descs", "get_xfer_descs",
             "get_plugin_list", "get_backend_mem_types", "get_agent_metadata"}
RAW_STATES = {"PROC", "DONE", "ERR"}


def _doctor_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybrid_transfer.doctor"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n.split(".")[2] for n in names if n.count(".") >= 2}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("hybrid_transfer.doctor.")}
    return found - {path.stem}


def test_the_doctor_modules_import_each_other_without_a_cycle():
    modules = {p.stem: p for p in DOCTOR.glob("*.py") if p.stem != "__init__"}
    graph = {name: _doctor_imports(path) & set(modules) for name, path in modules.items()}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle among doctor modules: {exc.args[1]}") from None
    assert order.index("types") < order.index("host") and order.index("types") < order.index("paths")


def test_no_doctor_module_calls_nixl_itself_and_the_engine_holds_no_diagnostics():
    for path in DOCTOR.glob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):  # check_nixl_import imports NIXL by name, to see that it can
            if isinstance(node, ast.Import):
                assert not any(NIXL_API.match(a.name) for a in node.names), path.name
            elif isinstance(node, ast.ImportFrom):
                assert not NIXL_API.match(node.module or ""), path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                assert called not in RAW_CALLS, f"{path.name}:{node.lineno} calls NIXL's {called} directly"
            elif isinstance(node, ast.Compare):
                strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
                assert not strings & RAW_STATES, f"{path.name}:{node.lineno} compares a raw NIXL state"
    assert not list(ENGINE.glob("diagnostics*.py"))


def test_the_loopback_children_import_neither_torch_nor_the_producer():
    code = ("import sys, hybrid_transfer.doctor.loopback_child, hybrid_transfer.engine.agent; "
            "print(sorted(m for m in ('torch', 'hybrid_transfer.engine.producer', 'hybrid_transfer.engine.consumer') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
