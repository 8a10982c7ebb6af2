"""The package's layering: no import circles, the engine free of the backends,
and every private module of dask and distributed imported in one adapter.

The import graph is read from the source (every ``import`` and ``from ...
import`` of a gpushuffle module, at any depth of the code, type-only ones
included), so a circle made by a lazy import counts too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gpushuffle"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:  # relative imports (none today)
                    package = name.rsplit(".", node.level)[0]
                    base = f"{package}.{base}" if base else package
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "gpushuffle.engine.run" in import_graph()["gpushuffle.api"]


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_engine_imports_nothing_of_the_backends():
    """Backends implement the engine's interface (engine/tables.py) and
    register themselves (engine/registry.py): the engine depends on neither."""
    graph = import_graph()
    offending = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("gpushuffle.engine")
        for target in targets
        if target.startswith("gpushuffle.backends")
    }
    assert not offending


def test_private_modules_of_dask_and_distributed_are_imported_in_one_adapter():
    private = re.compile(r"^\s*(from|import)\s+(distributed|dask)(\.\w+)*\._\w+", re.M)
    offenders = [
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name != "_distributed.py" and private.search(path.read_text())
    ]
    assert not offenders, "import them through gpushuffle/_distributed.py"
