"""The package's import graph, read from the source (imports inside functions
included): the kernels import each other in one direction only, and the
allreducers know nothing of the cost model that chooses among them."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

from conftest import ROOT


def relative_imports(folder: Path) -> Dict[str, Set[str]]:
    """Each module of ``folder`` -> the modules of the same folder it imports."""
    graph = {}
    for source in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.update([node.module] if node.module else [alias.name for alias in node.names])
        graph[source.stem] = {name.split(".")[0] for name in found}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every import cycle, as the path that closes it (the package's own
    ``__init__`` left out: a package may import its modules)."""
    found = []

    def walk(path: List[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt in graph and nxt != "__init__":
                walk(path + [nxt])

    for start in graph:
        if start != "__init__":
            walk([start])
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})[0] == ["a", "b", "c", "a"]
    assert cycles({"a": {"b"}, "b": set(), "__init__": {"a"}}) == []


def test_the_kernels_have_no_import_cycle():
    graph = relative_imports(ROOT / "kernels")
    assert "device_select" in graph["__init__"] and "selection" in graph["device_select"]  # the graph was read
    assert cycles(graph) == []


def test_the_collectives_import_nothing_of_the_cost_model_above_them():
    imported = set()
    for source in (ROOT / "spar_comm" / "collectives").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                imported.add((node.module or "").split(".")[0] or node.names[0].name)
    assert "consensus" in imported  # the imports were read
    assert "costmodel" not in imported
