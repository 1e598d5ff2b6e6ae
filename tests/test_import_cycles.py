"""No import cycle among the modules of ``marginkit``.

Imports inside functions count: a cycle hidden in a function body is still a cycle. The graph
is read from the source (``ast``), so the test sees every import, executed or not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import marginkit

SRC = Path(marginkit.__file__).parent.parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / "marginkit").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` (``from pkg import sub`` imports ``pkg.sub``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets = [f"{module}.{a.name}" for a in node.names]
                targets = [t if t in mods else module for t in targets]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    # evaluate imports the run directory module only inside functions
    assert "marginkit.train.rundir" in import_graph()["marginkit.train.evaluate"]


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "marginkit.train.errors" in graph["marginkit.train.registry"]  # the graph is read
    assert cycles(graph) == []
