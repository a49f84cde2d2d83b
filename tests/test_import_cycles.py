"""No import cycle in the ferrosync package or the torch hook module, lazy imports included.

Every ``import``/``from ... import`` anywhere in a module (at the top, inside functions,
under ``if TYPE_CHECKING``) and every ``importlib.import_module("literal")`` is an edge
to the module it names; ``from pkg import name`` is an edge to ``pkg.name`` when that is
a module, else to ``pkg``. A package does not implicitly depend on its submodules nor a
submodule on its package (every package with an ``__init__`` that re-exports would
otherwise be a cycle). Any strongly connected component of more than one module, or a
module importing itself, fails the test with the cycle's path.
"""

from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK = "ferrosync_autoload"


@functools.cache
def modules() -> dict[str, str]:
    """{dotted name: file} for the package and the hook module."""
    found = {HOOK: os.path.join(ROOT, f"{HOOK}.py")}
    for folder, _dirs, files in os.walk(os.path.join(ROOT, "ferrosync")):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join(rel)] = os.path.join(folder, name)
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def graph() -> dict[str, set[str]]:
    return edges(modules())


def edges(mods: dict[str, str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in mods else base)
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                targets.add(node.args[0].value)
        out[module] = {t for t in targets if t in mods}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node, and self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

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
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.unit
def test_no_import_cycles():
    assert HOOK in graph() and "ferrosync.ddp.factory" in graph()
    found = cycles(graph())
    assert not found, "import cycles (lazy imports included): " + "; ".join(
        " <-> ".join(c) for c in found)


@pytest.mark.unit
def test_the_detector_sees_lazy_and_relative_imports():
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": set()}
    assert cycles(toy) == [["a", "b", "c"], ["d"]]
    real = graph()
    # lazy (inside a function) and relative imports are edges
    assert "ferrosync.ddp.factory" in real[HOOK]
    assert "ferrosync.api" in real["ferrosync.ddp.factory"]
