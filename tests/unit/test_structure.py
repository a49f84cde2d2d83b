"""The package's structural rules, counted over the source (docs/design.md#layers).

Each test states one rule and fails with every place that breaks it: a private name used
outside the module that defines it, strategies branching on elastic membership, control
records written past the object layer, deadline loops outside the one wait primitive, an
option declared twice, long module docstrings, tests importing from ``tools/``.
"""

from __future__ import annotations

import ast
import functools
import os
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "ferrosync")


@functools.cache
def sources() -> dict[str, ast.Module]:
    """{path relative to the repository: parsed module} for every module of the package."""
    found = {}
    for folder, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    found[os.path.relpath(path, ROOT)] = ast.parse(f.read(), path)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, class attributes, module
    globals, ``self._x = ...`` attributes, and keyword-only dataclass fields."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute):
                        names.add(leaf.attr)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return {n for n in names if _private(n)}


@functools.cache
def all_defined() -> set[str]:
    out = set()
    for tree in sources().values():
        out |= defined_privates(tree)
    return out


@pytest.mark.xfail(strict=True, reason="Structure IV in progress: seams")
def test_no_module_uses_another_modules_private_names():
    """A private name (``_x``) of ferrosync's is used only in the module that defines it:
    a class shares state with another module through a declared interface, never through
    a mixin's or a base class's private attributes, and no module reaches into another's
    privates (``obj._x``, ``from m import _x``)."""
    ours = all_defined()
    found = []
    for path, tree in sorted(sources().items()):
        own = defined_privates(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                name = node.attr
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "ferrosync"):
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{path}:{node.lineno}: imports {alias.name}")
                continue
            else:
                continue
            if name in ours and name not in own:
                found.append(f"{path}:{node.lineno}: uses {name}")
    assert not found, "\n".join(found)


@pytest.mark.xfail(strict=True, reason="Structure IV in progress: membership event")
def test_strategies_do_not_branch_on_elastic_membership():
    """Membership changes reach a strategy as the elastic layer's event, never as a test
    of ``sync.elastic`` (or any name with ``elastic`` in it) inside the strategy."""
    found = []
    for path, tree in sorted(sources().items()):
        if not path.startswith(os.path.join("ferrosync", "strategies")):
            continue
        for node in ast.walk(tree):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name) else "")
            if "elastic" in name.lower():
                found.append(f"{path}:{node.lineno}: {name}")
    assert not found, "\n".join(found)


#: the object layer: the one caller of an engine's writes of control records and of
#: exclusive creates (the engines themselves, and the operator tools, which write no
#: record of a job, are outside the collective path)
OBJECT_LAYER = os.path.join("ferrosync", "storage", "objects.py")


@pytest.mark.xfail(strict=True, reason="Structure IV in progress: records")
def test_records_and_exclusive_creates_go_through_the_object_layer():
    """``put(..., exclusive=...)``, ``encode_record`` and ``decode_record``/``open_record``
    are called only by the object layer (and the engines and wire format they belong to)."""
    allowed = (OBJECT_LAYER, os.path.join("ferrosync", "storage", "engines"),
               os.path.join("ferrosync", "storage", "wire.py"),
               os.path.join("ferrosync", "testing"))
    found = []
    for path, tree in sorted(sources().items()):
        if path.startswith(allowed):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            exclusive = name == "put" and any(k.arg == "exclusive" for k in node.keywords)
            if exclusive or name in ("encode_record", "decode_record", "open_record"):
                found.append(f"{path}:{node.lineno}: {name}")
    assert not found, "\n".join(found)


#: the one bounded-wait primitive
WAIT_HOME = os.path.join("ferrosync", "core", "runtime.py")


def _reads_a_clock(node: ast.AST) -> bool:
    for leaf in ast.walk(node):
        name = (leaf.attr if isinstance(leaf, ast.Attribute)
                else leaf.id if isinstance(leaf, ast.Name) else "")
        if name in ("monotonic", "deadline", "time", "now"):
            return True
    return False


@pytest.mark.xfail(strict=True, reason="Structure IV in progress: waits")
def test_deadline_loops_have_one_home():
    """A loop that waits until a deadline (a ``while`` whose test or body reads a clock
    and sleeps) is written once, in the runtime's wait primitive; every other wait calls
    it."""
    found = []
    for path, tree in sorted(sources().items()):
        if path == WAIT_HOME or path.startswith(os.path.join("ferrosync", "testing")):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.While):
                continue
            sleeps = any(isinstance(n, ast.Call) and (getattr(n.func, "attr", "") or
                         getattr(n.func, "id", "")) in ("sleep", "wait")
                         for n in ast.walk(node))
            if sleeps and _reads_a_clock(node):
                found.append(f"{path}:{node.lineno}")
    assert not found, "\n".join(found)


@pytest.mark.xfail(strict=True, reason="Structure IV in progress: options")
def test_no_option_field_is_declared_twice():
    """Each option is declared once, in one dataclass; the backends that take it share
    that declaration."""
    seen: dict[str, str] = {}
    found = []
    for path, tree in sorted(sources().items()):
        for cls in ast.walk(tree):
            if not (isinstance(cls, ast.ClassDef) and cls.name.endswith("Options")):
                continue
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    name = stmt.target.id
                    where = f"{path}:{stmt.lineno} ({cls.name})"
                    if name in seen:
                        found.append(f"{name}: {seen[name]} and {where}")
                    else:
                        seen[name] = where
    assert not found, "\n".join(found)


#: the most lines a module's docstring may run to: its role and contract in a few lines
DOCSTRING_LINES = 12


@pytest.mark.xfail(strict=True, reason="Structure IV in progress: docstrings")
def test_module_docstrings_are_short():
    found = []
    for path, tree in sorted(sources().items()):
        doc = ast.get_docstring(tree, clean=False) or ""
        if doc.count("\n") + 1 > DOCSTRING_LINES:
            found.append(f"{path}: {doc.count(chr(10)) + 1} lines")
    assert not found, "\n".join(found)


def test_tests_import_nothing_from_tools():
    """Tests import the package and ``ferrosync.testing``; a benchmark, a document
    generator or a drill in ``tools/`` is run as a script, never imported."""
    found = []
    for folder, _dirs, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for match in re.finditer(r"^\s*(?:from tools\b|import tools\b)", text, re.M):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{os.path.relpath(path, ROOT)}:{line}")
    assert not found, "\n".join(found)


#: who may import whom (docs/design.md#layers): a layer imports itself, the layers it
#: names here, and what they may import; ``train``, ``ops``, ``testing`` and the
#: package's ``__init__``/``__main__`` sit on top and may import any layer
LAYERS = {
    "errors": set(),
    "core": {"errors"},
    "compression": {"core"},
    "api": {"core", "compression"},
    "partition": {"core"},
    "storage": {"api"},
    "torchdist": {"ddp"},
    "elastic": {"storage"},
    "ddp": {"storage"},
    "strategies": {"api"},
}


def _reach(layer: str) -> set[str]:
    out, todo = {layer}, [layer]
    while todo:
        for below in LAYERS.get(todo.pop(), ()):
            if below not in out:
                out.add(below)
                todo.append(below)
    return out


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


@pytest.mark.xfail(strict=True, reason="Structure IV in progress: layers")
def test_layers_import_only_what_they_stand_on():
    found = []
    for path, tree in sorted(sources().items()):
        module = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
        layer = _layer(module)
        if layer not in LAYERS:
            continue
        allowed = _reach(layer)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("ferrosync.") and _layer(target) not in allowed:
                    found.append(f"{path}:{node.lineno}: {layer} imports {target}")
    assert not found, "\n".join(found)
