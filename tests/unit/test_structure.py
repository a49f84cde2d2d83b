"""The package's structural rules, counted over the source (docs/design.md#layers).

Each test states one rule and fails with every place that breaks it: a private name used
outside the module that defines it, strategies branching on elastic membership, control
records written past the object layer, deadline loops outside the one wait primitive, an
option declared twice, long module docstrings, tests importing from ``tools/``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import glob
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
        # a storage that wraps another implements ``put`` by passing its caller's
        # ``exclusive`` on: it is the engine interface, not a caller of it
        forwards = {id(call) for fn in ast.walk(tree)
                    if isinstance(fn, ast.FunctionDef) and fn.name == "put"
                    for call in ast.walk(fn) if isinstance(call, ast.Call)
                    and any(k.arg == "exclusive" and isinstance(k.value, ast.Name)
                            and k.value.id == "exclusive" for k in call.keywords)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in forwards:
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


def test_layers_import_only_what_they_stand_on():
    """Each layer imports only the layers below it (``LAYERS``); nothing outside
    ``ferrosync/testing/`` imports it (the test tools sit above the product: the one
    hook that reaches a test layer, ``open_storage``'s fault hook, names it as a string)."""
    found = []
    for path, tree in sorted(sources().items()):
        module = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
        layer = _layer(module)
        if layer not in LAYERS:
            allowed = None if layer == "testing" else {"*"}
        else:
            allowed = _reach(layer)
        if allowed is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if not target.startswith("ferrosync."):
                    continue
                if "*" in allowed and _layer(target) != "testing":
                    continue
                if _layer(target) not in allowed:
                    found.append(f"{path}:{node.lineno}: {layer} imports {target}")
    assert not found, "\n".join(found)


DESIGN = os.path.join(ROOT, "docs", "design.md")
#: names design.md quotes that are not ferrosync's (torch's, fsspec's, S3's, botocore's) or
#: that are store names, not code
FOREIGN = {"GradScaler", "CompleteMultipartUpload", "ListMultipartUploads", "NoSuchUpload",
           "s3.payload_signing_enabled", "pipe_file", "exists", "rdzv/",
           "ferrosync.backends"}  # the entry-point group's name, not a module
_TICKED = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"[\w*][\w./*-]*(?:\.py|/)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_BARE = re.compile(r"_?[A-Z]\w*[a-z]\w*|_\w+")


@functools.cache
def _definitions() -> tuple[dict, dict]:
    """({dotted module: names it defines or imports at top level},
    {class name: (names its body defines, its bases' names)}) over the package, the two
    top-level modules and the suite's fakes."""
    modules, classes = {}, {}
    trees = dict(sources())
    for extra in ("ferrosync_schemes.py", "ferrosync_autoload.py",
                  os.path.join("tests", "fakes.py")):
        with open(os.path.join(ROOT, extra), encoding="utf-8") as f:
            trees[extra] = ast.parse(f.read(), extra)
    for path, tree in trees.items():
        module = path[:-3].replace(os.sep, ".").removesuffix(".__init__")
        top = set()
        for node in tree.body:
            top |= _bound(node)
        modules[module] = top
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                body = set().union(*(_bound(s) for s in node.body))
                body |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                         and isinstance(n.ctx, ast.Store)}
                names, bases = classes.setdefault(node.name, (set(), set()))
                names |= body
                bases |= {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                          for b in node.bases}
    return modules, classes


def _bound(node: ast.AST) -> set[str]:
    """The names one statement binds: a def, a class, an assignment, an import."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {leaf.id for t in targets for leaf in ast.walk(t) if isinstance(leaf, ast.Name)}
        if "__all__" in names or any("LAZY" in n for n in names):
            # names a module exports lazily (``__getattr__`` over a table) are its own too
            names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                      and isinstance(c.value, str) and c.value.isidentifier()}
        return names
    if isinstance(node, (ast.If, ast.Try)):
        return set().union(*(_bound(s) for s in node.body), set())
    return set()


def _in_class(cls: str, name: str, seen=()) -> bool:
    names, bases = _definitions()[1].get(cls, (set(), set()))
    return name in names or any(_in_class(b, name, (*seen, cls)) for b in bases
                                if b not in seen)


def _resolves(dotted: str) -> bool | None:
    """True/False for a dotted name of ferrosync's; None for one that is not ours."""
    modules, classes = _definitions()
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        found = [m for m in modules if m == head or m.endswith("." + head)]
        if found:
            rest = parts[cut:]
            return not rest or any(_member(modules[m], m, rest) for m in found)
    if parts[0] in classes:
        return _in_class(parts[0], parts[1])
    return None


def _member(top: set[str], module: str, rest: list[str]) -> bool:
    if rest[0] not in top:
        return False
    return len(rest) == 1 or _in_class(rest[0], rest[1])


def _ticked(text: str) -> list[tuple[int, str]]:
    """(line, backticked text) outside fenced blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced:
            out += [(number, m.group(1).strip()) for m in _TICKED.finditer(line)]
    return out


def stale_names(markdown: str) -> list[str]:
    """What of the modules, classes and functions a Markdown text names in backticks
    does not exist, as ``line: what``.

    Recognised forms (anything else in backticks — commands, options, record and object
    names, values — is prose): a path ending in ``.py`` or ``/`` (globs allowed), relative
    to the repository or to ``ferrosync/`` (a bare file name: anywhere in the package),
    optionally followed by ``.Name`` (``storage/objects.Objects``); a dotted name whose
    head is one of our modules, by its full or its last dotted name (``wire.seal``,
    ``ferrosync.ddp.register``) or one of our classes (``Storage.read``, methods and
    attributes of its bases count); a bare class name (a capitalised word with a
    lower-case letter: ``GradSync``); a bare private name (``_create``) or a bare call
    (``shard_indices(...)``), defined anywhere. A trailing ``(...)`` is ignored; builtins
    and ``FOREIGN`` are not ours. "Ours" is the package, the two top-level modules and
    ``tests/fakes.py``.
    """
    modules, classes = _definitions()
    everything = set().union(*modules.values(), *(n for n, _b in classes.values()))
    found = []
    for line, text in _ticked(markdown):
        if text in FOREIGN or " " in text.split("(")[0] or hasattr(builtins, text):
            continue
        name = text.split("(")[0].rstrip("/") + ("/" if text.endswith("/") else "")
        if name in FOREIGN:
            continue
        slashed = re.fullmatch(r"([\w/]+)\.([A-Za-z_]\w*)", name)
        if "/" in name and slashed and slashed.group(2) != "py":
            file, member = slashed.group(1) + ".py", slashed.group(2)  # path/module.Name
        elif ("/" in name or name.endswith(".py")) and _PATH.fullmatch(name):
            file, member = name, ""
        elif "/" in name or name.endswith(".py"):
            continue  # a store name or a pattern with placeholders, not a repository path
        else:
            file = None
        if file is not None:
            if name.startswith((".", "/")):
                continue
            hits = [p for base in (ROOT, PACKAGE)
                    for p in glob.glob(os.path.join(base, file))]
            if "/" not in file:  # a file of the package named in its folder's row
                hits += glob.glob(os.path.join(PACKAGE, "**", file), recursive=True)
            if not hits:
                found.append(f"{line}: no file {file}")
            elif member:
                module = os.path.relpath(hits[0], ROOT)[:-3].replace(os.sep, ".")
                if member not in modules.get(module.removesuffix(".__init__"), ()):
                    found.append(f"{line}: {file} has no {member}")
        elif _DOTTED.fullmatch(name):
            if _resolves(name) is False:
                found.append(f"{line}: no {name}")
        elif _BARE.fullmatch(name) or ("(" in text and name.isidentifier()):
            if name not in everything and name not in classes:
                found.append(f"{line}: no {name}")
    return found


def test_every_name_design_md_gives_exists():
    """Every module, class and function docs/design.md names in backticks exists (the
    forms ``stale_names`` recognises)."""
    with open(DESIGN, encoding="utf-8") as f:
        found = stale_names(f.read())
    assert not found, "\n".join(f"docs/design.md:{line}" for line in found)


def test_stale_names_finds_every_form_it_recognises():
    """The check can fail: one stale name of each recognised form is reported, and the
    same forms naming what exists, prose and fenced code are not."""
    real = ("`core/guard.py` `storage/objects.Objects` `wire.seal` `ferrosync.ddp.register` "
            "`Storage.read` `GradSync` `_create` `shard_indices(n, 0, 2)` `process_group.py` "
            "`tests/fakes.py` `FakeClock` `torch.load(weights_only=True)` `poll_initial` "
            "`c{s}.r{k}` `rdzv.{job}/` `python -m ferrosync.train`\n"
            "```python\n`storage/gone.py` `NoSuchClass`\n```\n")
    assert stale_names(real) == []
    stale = ("`storage/gone.py` `storage/objects.Gone` `wire.gone` `ferrosync.ddp.gone` "
             "`Storage.gone` `GoneSync` `_gone_private` `gone_function(x)`\n")
    assert stale_names(stale) == [
        "1: no file storage/gone.py", "1: storage/objects.py has no Gone", "1: no wire.gone",
        "1: no ferrosync.ddp.gone", "1: no Storage.gone", "1: no GoneSync",
        "1: no _gone_private", "1: no gone_function"]
