"""Where a backend declares itself (docs/design.md#registry): one ``register(...)`` per
backend, imported lazily.

A registration names, in one place, everything the rest of the code and the docs
need to know about a backend (as fsspec's ``register_implementation`` does for a
filesystem): the ``GradSync`` class, its options dataclass, and how ``connect``
chooses it (URL schemes, an option, or ``elastic=True``). From the registrations:

* ``connect`` picks the class (``backend_for``, ``elastic_connector``);
* ``tools/options_table.py`` writes the README's option table of each one (between
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

from .storage import split_url


@dataclass(frozen=True)
class Registration:
    """One backend, as ``connect`` chooses it and the docs and tests list it."""

    #: the README table's name (``<!-- options:NAME -->``) and the backend's short name
    name: str
    #: ``"module:Class"`` of the ``GradSync`` subclass
    backend: str
    #: ``"module:Class"`` of its ``BackendOptions`` dataclass (``backends/options.py``)
    options: str
    #: URL schemes it serves; empty: storage URLs (a directory or an fsspec store)
    schemes: tuple[str, ...] = ()
    #: a storage URL goes to this backend when this option is given (not None)
    option: str | None = None
    #: ``"module:function"`` that ``connect(url, elastic=True)`` calls instead of the class
    elastic: str | None = None

    def load_backend(self):
        return _load(self.backend)

    def load_options(self):
        return _load(self.options)


#: every backend, by name, in registration order (the README's table order)
REGISTRY: dict[str, Registration] = {}


def register(name: str, *, backend: str, options: str, schemes: tuple[str, ...] = (),
             option: str | None = None, elastic: str | None = None) -> Registration:
    """Declare a backend (see ``Registration``). A name, a scheme, a selecting option or
    the elastic connector already taken by another registration is a ``ValueError``:
    ``connect`` must never have two answers for one URL."""
    entry = Registration(name, backend, options, tuple(schemes), option, elastic)
    if name in REGISTRY:
        raise ValueError(f"backend {name!r} is already registered")
    if len([f for f in (schemes, option, elastic) if f]) > 1:
        raise ValueError(f"backend {name!r}: give schemes, option or elastic, not several")
    for other in REGISTRY.values():
        taken = set(other.schemes) & set(entry.schemes)
        if taken:
            raise ValueError(f"scheme(s) {sorted(taken)} already serve backend {other.name!r}")
        if option is not None and other.option == option:
            raise ValueError(f"option {option!r} already selects backend {other.name!r}")
        if elastic is not None and other.elastic is not None:
            raise ValueError(f"backend {other.name!r} already serves elastic=True")
        if not (schemes or option or elastic or other.schemes or other.option
                or other.elastic):
            raise ValueError(f"backend {other.name!r} already serves storage URLs")
    REGISTRY[name] = entry
    return entry


# -- the built-in backends --------------------------------------------------------------------

register("storage", backend="ferrosync.backends.files:FileSync",
         options="ferrosync.backends.options:StorageOptions")
register("torch", backend="ferrosync.backends.torchdist:TorchDistSync",
         options="ferrosync.backends.options:TorchOptions", schemes=("gloo", "nccl", "torch"))
register("hierarchical", backend="ferrosync.backends.hierarchical:HierarchicalSync",
         options="ferrosync.backends.options:HierarchicalOptions", option="local")
register("elastic", backend="ferrosync.elastic:ElasticSync",
         options="ferrosync.backends.options:ElasticOptions",
         elastic="ferrosync.elastic:connect_elastic")


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def torch_schemes() -> set[str]:
    """Schemes served by a backend of their own (every other URL is a storage URL)."""
    return {scheme for entry in REGISTRY.values() for scheme in entry.schemes}


#: kept for callers that test a scheme (``train/runner.py``); derived, not a second list
TORCH_SCHEMES = frozenset(torch_schemes())


def _storage_entry() -> Registration:
    return next(e for e in REGISTRY.values() if not (e.schemes or e.option or e.elastic))


def storage_backend():
    """The GradSync class of storage URLs: a backend that composes others (the two-level
    sync meets its node leaders through storage) asks here instead of importing it."""
    return _storage_entry().load_backend()


def registration_for(url: str, options: dict | None = None) -> Registration:
    """The registration serving ``url`` with ``options`` (not elastic)."""
    scheme, _ = split_url(url)
    for entry in REGISTRY.values():
        if scheme in entry.schemes:
            return entry
    for entry in REGISTRY.values():
        if entry.option is not None and (options or {}).get(entry.option) is not None:
            return entry
    return _storage_entry()


def backend_for(url: str, options: dict | None = None):
    """The GradSync subclass serving ``url`` (validation of the URL itself is its job).

    A storage URL with ``local=...`` gets the two-level backend (nodes reduce locally,
    leaders meet through the storage).
    """
    return registration_for(url, options).load_backend()


def elastic_connector(url: str, options: dict | None = None):
    """The connector for ``connect(url, elastic=True)``: elastic jobs run on the storage
    transport only (a directory or an object store, without ``local=``)."""
    from .errors import ConfigError

    if registration_for(url, options) is not _storage_entry():
        raise ConfigError(f"elastic=True needs a storage URL (a directory or an "
                          f"object store, without local=), got {url!r}")
    return _load(next(e.elastic for e in REGISTRY.values() if e.elastic))


def option_tables() -> dict:
    """README table name -> options dataclass, one per registration, in order."""
    return {entry.name: entry.load_options() for entry in REGISTRY.values()}
