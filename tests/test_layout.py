"""The house's shape, checked: no import cycle, arrows one way, small modules, a short public face.

The imports are read with ``ast`` from the source (every ``import`` and ``from ... import``
anywhere in a module, inside functions and ``TYPE_CHECKING`` blocks too: a lazy import
is still an arrow), so no third-party tool is needed and nothing is imported to check it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "labserver"
MAX_LINES = 400  # a module past ~400 lines is two ideas: split it

# room -> rooms it must never import (DESIGN.md: models and strategies at the bottom; engine -> server ->
# launch; loadgen and load/ talk HTTP only; analysis -> plots; experiments, lab and cli on top)
FORBIDDEN = {
    "strategies": {"models", "engine", "server", "launch", "load", "loadgen", "analysis", "plots", "experiments",
                   "lab", "cli", "config", "replicas"},
    "models": {"strategies", "engine", "server", "launch", "load", "loadgen", "analysis", "plots", "experiments",
               "lab", "cli", "config", "replicas"},
    "engine": {"server", "launch", "load", "loadgen", "analysis", "plots", "experiments", "lab", "cli", "config",
               "replicas"},
    "server": {"launch", "load", "loadgen", "analysis", "plots", "experiments", "lab", "cli", "replicas"},
    "load": {"strategies", "models", "engine", "server", "launch", "plots", "experiments", "lab", "cli", "config",
             "replicas"},
    "loadgen": {"strategies", "models", "engine", "server", "launch", "plots", "experiments", "lab", "cli",
                "config", "replicas"},
    "analysis": {"strategies", "models", "engine", "server", "launch", "load", "loadgen", "plots", "experiments",
                 "lab", "cli", "config", "replicas"},
    "plots": {"strategies", "models", "engine", "server", "launch", "load", "loadgen", "experiments", "lab", "cli",
              "replicas"},
    "wire": {"strategies", "models", "engine", "server", "launch", "load", "loadgen", "analysis", "plots",
             "experiments", "lab", "cli", "config", "replicas"},
    # replicas: the ingress and replica deployments over server/ and engine/, started by launch
    "replicas": {"launch", "load", "loadgen", "analysis", "plots", "experiments", "lab", "cli"},
    # routing policies decide in the live routers and on the virtual clock alike: they know nothing else
    "routing": {"strategies", "models", "engine", "server", "launch", "load", "loadgen", "analysis", "plots",
                "experiments", "lab", "cli", "config", "replicas"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
# parsed once, at collection: CPython 3.11.7's ast.parse can fail with "AST constructor recursion
# depth mismatch" (a SystemError) when called after other tests have run in the same process
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def resolve(importer: str, node: ast.ImportFrom | ast.Import) -> set[str]:
    """The labserver modules one import statement loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    if node.level:  # relative: from the importer's package, up level - 1
        package = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
        base = ".".join(package[: len(package) - (node.level - 1)])
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    if not target.startswith("labserver"):
        return set()
    out = set()
    for alias in node.names:  # `from pkg import module` loads pkg.module; `from module import name`, module
        sub = f"{target}.{alias.name}"
        out.add(sub if sub in MODULES else target)
    return {m for m in out if m in MODULES}


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name in MODULES:
        graph[name]  # every module is a node, even one that imports nothing
        for node in ast.walk(TREES[name]):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= resolve(name, node) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
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


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "labserver"


def test_the_graph_is_read_from_the_source() -> None:
    graph = import_graph()
    assert "labserver.strategies" in graph["labserver.engine.batch"]
    assert "labserver.engine.step" in graph["labserver.engine"]  # `from .step import ...` in a package
    assert "labserver.wire" in graph["labserver.server.encode"]  # `from .. import wire`


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (arrows must point one way): " + "; ".join(" <-> ".join(c) for c in found)


def test_arrows_point_one_way() -> None:
    wrong = [f"{m} imports {t}" for m, targets in import_graph().items() for t in sorted(targets)
             if room(t) in FORBIDDEN.get(room(m), set())]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it by idea"


def test_no_private_name_crosses_a_module() -> None:
    """``from x import _y`` between labserver modules: make it public or move it to where it is used."""
    crossing = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("labserver")):
                crossing += [f"{name}: {alias.name}" for alias in node.names
                             if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not crossing, crossing


def test_the_public_face_is_listed() -> None:
    import labserver

    assert sorted(labserver.__all__) == sorted(set(labserver.__all__))
    assert all(hasattr(labserver, name) for name in labserver.__all__)
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in labserver.__all__ if f"`{name}`" not in readme]
    assert not missing, f"the README's public API list lacks {missing}"
