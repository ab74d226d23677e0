"""Dependencies flow one way: ddbench (CLI, routines) -> ddbench.engine -> ddbench.kernels.

Every module imports, and the import graph (every `import` statement, module level or
inside a function) has no cycle among ddbench's modules; nothing in ddbench.kernels imports
ddbench.engine or a CLI module; nothing in ddbench.engine imports a CLI module. The package
root `ddbench` (its `UserError`) counts as neither."""
import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"ddbench": ROOT / "ddbench", "ddbench.kernels": ROOT / "kernels", "ddbench.engine": ROOT / "engine"}
SKIP = {"ddbench.__main__"}   # runs the CLI when imported


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in FOLDERS.items():
        for path in sorted(folder.glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            if name not in SKIP:
                out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The ddbench modules `name` imports anywhere in its source (packages count as their
    __init__; `from P import m` counts as P.m where m is a module)."""
    out = set()
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:      # `import ddbench.kernels.x.y` -> the longest known module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    if name == "ddbench":
        return "root"
    if name == "ddbench.kernels" or name.startswith("ddbench.kernels."):
        return "kernels"
    if name == "ddbench.engine" or name.startswith("ddbench.engine."):
        return "engine"
    return "cli"


def test_the_graph_sees_the_known_edges():
    """The scanner finds imports at module level and inside functions."""
    assert "ddbench.kernels.pdl" in GRAPH["ddbench.kernels.skinny"]
    assert "ddbench.engine.build" in GRAPH["ddbench.decode"]
    assert "ddbench.kernels.select" in GRAPH["ddbench.engine.model"]
    assert "ddbench.envinfo" in GRAPH["ddbench.cli"]                  # lazy, inside `env`
    assert "ddbench.kernels.mla_decode" in GRAPH["ddbench.kernels.select"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("layer,forbidden", [("kernels", {"engine", "cli"}), ("engine", {"cli"})])
def test_dependencies_flow_one_way(layer, forbidden):
    bad = sorted(f"{m} -> {t}" for m, deps in GRAPH.items() if _layer(m) == layer
                 for t in deps if _layer(t) in forbidden)
    assert not bad, bad


def test_no_import_cycles():
    """Tarjan's strongly connected components of the import graph: every one a single module."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w == "ddbench":
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, cycles
