"""Where a backend declares itself (docs/design.md#registry): one ``register(...)`` per
backend, imported lazily.

A registration names, in one place, everything the rest of the code and the docs
need to know about a backend (as fsspec's ``register_implementation`` does for a
filesystem): the ``GradSync`` class, its options dataclass, and how ``connect``
chooses it (URL schemes, or an option that selects it on a storage URL: ``local=``
for the two-level sync, ``elastic=True`` for an elastic job). From the registrations:

* ``connect`` picks the class (``registration_for``, ``backend_for``) and constructs
  every backend alike: its ``check_options`` validates the options (the selecting one
  included), its ``identity`` says who this process is, then the class is called;
* ``tools/docs/options_table.py`` writes docs/reference.md's option table of each one (between
  ``<!-- options:NAME -->`` markers; ``tests/test_docs.py`` checks they match);
* ``tests/test_registry.py`` checks that the contract matrix (``tests/conftest.py``)
  exercises every registered backend, so a registration without contract coverage
  fails the suite.

Classes are named as ``"module:Class"`` strings and imported on first use:
``import ferrosync`` stays cheap (no fsspec, s3fs or CUDA initialisation until a URL
needs them), and this module imports no backend, so backends may import it (the
two-level sync gets the storage backend from ``storage_backend()``). A missing driver
is reported with the command that installs it (see ``storage.open_storage``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ferrosync.storage.engines import split_url


@dataclass(frozen=True)
class Registration:
    """One backend, as ``connect`` chooses it and the docs and tests list it."""

    #: the option table's name (``<!-- options:NAME -->``) and the backend's short name
    name: str
    #: ``"module:Class"`` of the ``GradSync`` subclass
    backend: str
    #: ``"module:Class"`` of its ``BackendOptions`` dataclass (``storage/options.py``)
    options: str
    #: URL schemes it serves; empty: storage URLs (a directory or an fsspec store)
    schemes: tuple[str, ...] = ()
    #: a storage URL goes to this backend when this option is given a value other
    #: than None or False (``local="gloo"``, ``elastic=True``); it is one of the
    #: backend's options
    option: str | None = None

    def load_backend(self):
        return _load(self.backend)

    def load_options(self):
        return _load(self.options)


#: every backend, by name, in registration order (docs/reference.md's table order)
REGISTRY: dict[str, Registration] = {}


def register(name: str, *, backend: str, options: str, schemes: tuple[str, ...] = (),
             option: str | None = None) -> Registration:
    """Declare a backend (see ``Registration``). A name, a scheme or a selecting option
    already taken by another registration is a ``ValueError``: ``connect`` must never
    have two answers for one URL."""
    entry = Registration(name, backend, options, tuple(schemes), option)
    if name in REGISTRY:
        raise ValueError(f"backend {name!r} is already registered")
    if schemes and option:
        raise ValueError(f"backend {name!r}: give schemes or option, not both")
    for other in REGISTRY.values():
        taken = set(other.schemes) & set(entry.schemes)
        if taken:
            raise ValueError(f"scheme(s) {sorted(taken)} already serve backend {other.name!r}")
        if option is not None and other.option == option:
            raise ValueError(f"option {option!r} already selects backend {other.name!r}")
        if not (schemes or option or other.schemes or other.option):
            raise ValueError(f"backend {other.name!r} already serves storage URLs")
    REGISTRY[name] = entry
    return entry


# -- the built-in backends --------------------------------------------------------------------

register("storage", backend="ferrosync.storage.sync:FileSync",
         options="ferrosync.storage.options:StorageOptions")
register("torch", backend="ferrosync.torchdist.sync:TorchDistSync",
         options="ferrosync.storage.options:TorchOptions", schemes=("gloo", "nccl", "torch"))
register("hierarchical", backend="ferrosync.torchdist.hierarchical:HierarchicalSync",
         options="ferrosync.storage.options:HierarchicalOptions", option="local")
register("elastic", backend="ferrosync.elastic:ElasticSync",
         options="ferrosync.storage.options:ElasticOptions", option="elastic")


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def torch_schemes() -> set[str]:
    """Schemes served by a backend of their own (every other URL is a storage URL)."""
    return {scheme for entry in REGISTRY.values() for scheme in entry.schemes}


#: kept for callers that test a scheme (``train/runner.py``); derived, not a second list
TORCH_SCHEMES = frozenset(torch_schemes())


def _storage_entry() -> Registration:
    return next(e for e in REGISTRY.values() if not (e.schemes or e.option))


def storage_backend():
    """The GradSync class of storage URLs: a backend that composes others (the two-level
    sync meets its node leaders through storage) asks here instead of importing it."""
    return _storage_entry().load_backend()


def _selects(entry: Registration, options: dict | None) -> bool:
    return entry.option is not None and (options or {}).get(entry.option) not in (None, False)


def selected_options(options: dict) -> dict:
    """``options`` without selecting options left at their "off" value (``local=None``,
    ``elastic=False``): they select nothing, and the backend chosen does not take them."""
    off = {e.option for e in REGISTRY.values() if e.option is not None}
    return {k: v for k, v in options.items() if not (k in off and v in (None, False))}


def registration_for(url: str, options: dict | None = None) -> Registration:
    """The registration serving ``url`` with ``options``: the one whose scheme it is,
    else the one a selecting option names, else the storage backend. A selecting option
    on another backend's URL, or two of them, is a ``ConfigError`` (one answer per URL)."""
    scheme, _ = split_url(url)
    chosen = [e for e in REGISTRY.values() if scheme in e.schemes]
    selecting = [e for e in REGISTRY.values() if _selects(e, options)]
    if selecting and (chosen or len(selecting) > 1):
        from ferrosync.errors import ConfigError

        given = " with ".join(f"{e.option}={options[e.option]!r}" for e in selecting)
        raise ConfigError(f"{given} needs a storage URL (a directory or an object store, "
                          f"and no other backend's option), got {url!r}",
                          hint="give one selecting option, with a storage URL")
    return (chosen or selecting or [_storage_entry()])[0]


def backend_for(url: str, options: dict | None = None):
    """The GradSync subclass serving ``url`` (validation of the URL itself is its job).

    A storage URL with ``local=...`` gets the two-level backend (nodes reduce locally,
    leaders meet through the storage), one with ``elastic=True`` an elastic job's member.
    """
    return registration_for(url, options).load_backend()


def option_tables() -> dict:
    """Option table name -> options dataclass, one per registration, in order."""
    return {entry.name: entry.load_options() for entry in REGISTRY.values()}
