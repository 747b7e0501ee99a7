"""layout/ imports point one way: no module of the package reaches itself again through imports.

Read from the source with ``ast``, so imports inside functions and under ``TYPE_CHECKING`` count too:
a deferred import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "hybrid_transfer.layout"
ROOT = Path(__file__).resolve().parents[2] / "hybrid_transfer" / "layout"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _imported(tree: ast.AST, modules: set[str], this: str) -> set[str]:
    """The package's modules that ``tree`` imports (``from pkg import name`` counts pkg.name when a module)."""
    found: set[str] = set()
    package = this if (ROOT / Path(*this.split(".")[2:]) / "__init__.py").exists() else this.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            # The longest prefix that is a module of the package is the edge. Python also runs the
            # package's __init__ first, but __init__ only re-exports: a circle needs a module that
            # imports the package itself (`from hybrid_transfer.layout import X`), which is an edge here.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imported(ast.parse(p.read_text(), str(p)), modules, _module_name(p)) for p in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert f"{PACKAGE}.geometry" in graph and f"{PACKAGE}.engine_spec" in graph
    assert f"{PACKAGE}.geometry" in graph[f"{PACKAGE}.engine_spec"]  # engine_spec builds geometries


def test_the_cycle_finder_finds_a_planted_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layout_has_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle in layout/: " + " -> ".join(cycle)
