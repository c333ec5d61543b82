"""The package's import graph, read from the source (imports inside functions
included): the kernels import each other in one direction only, the
allreducers know nothing of the cost model that chooses among them, and the
drivers are command lines over the library: none imports another, and no
test imports one (a test runs a driver as a program or tests the library)."""
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


# -- the drivers are command lines over the library ----------------------------------------
DRIVERS = {source.stem for source in (ROOT / "drivers").glob("*.py")}


def imported_modules(tree: ast.AST) -> Set[str]:
    """Every module ``tree`` imports, by its full dotted name (relative ones as written)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                found.add(str(node.args[0].value))
    return found


def reaches_drivers(tree: ast.AST) -> List[str]:
    """What in ``tree`` loads code from drivers/: sys.path changed to name it, or
    a module made from a file there (spec_from_file_location, runpy, SourceFileLoader)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        function = ast.unparse(node.func)
        text = ast.unparse(node)
        if function.startswith("sys.path.") or function in ("spec_from_file_location", "importlib.util.spec_from_file_location",
                                                             "runpy.run_path", "SourceFileLoader",
                                                             "importlib.machinery.SourceFileLoader"):
            if "drivers" in text:
                found.append(text)
    for node in ast.walk(tree):  # sys.path[:0] = [...], sys.path += [...]
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t).startswith("sys.path") for t in targets) and "drivers" in ast.unparse(node.value):
                found.append(ast.unparse(node))
    return found


def test_the_finders_find_a_driver_import_and_a_path_to_drivers():
    tree = ast.parse("import bench_comm\nfrom train import make_parser\n"
                     "sys.path.insert(0, str(ROOT / 'drivers'))\nsys.path[:0] = [str(ROOT / 'drivers')]\n"
                     "SPEC = importlib.util.spec_from_file_location('p', 'drivers/predict.py')\n")
    assert {"bench_comm", "train"} <= imported_modules(tree)
    assert len(reaches_drivers(tree)) == 3


def test_no_driver_imports_another_or_reaches_drivers_through_sys_path():
    assert {"train", "bench_comm", "bench_peers", "predict"} <= DRIVERS  # the drivers were found
    for source in sorted((ROOT / "drivers").glob("*.py")):
        tree = ast.parse(source.read_text())
        others = {name.split(".")[0] for name in imported_modules(tree)} & (DRIVERS - {source.stem})
        assert not others, f"{source.name} imports the drivers {sorted(others)}"
        assert not any(ast.unparse(node).startswith("sys.path") for node in ast.walk(tree)
                       if isinstance(node, (ast.Call, ast.Assign, ast.AugAssign))), f"{source.name} changes sys.path"


def test_no_test_imports_a_driver():
    tests = sorted((ROOT / "tests").glob("*.py"))
    assert any(source.name == "test_peers.py" for source in tests)  # the tests were found
    local = {source.stem for source in tests}
    for source in tests:
        tree = ast.parse(source.read_text())
        drivers = {name.split(".")[0] for name in imported_modules(tree)} & DRIVERS - local
        assert not drivers, f"{source.name} imports the drivers {sorted(drivers)}"
        assert not reaches_drivers(tree), f"{source.name} loads code from drivers/: {reaches_drivers(tree)}"
