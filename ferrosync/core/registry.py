"""Where a backend declares itself: one ``register(...)`` per backend, imported lazily
(docs/design.md#registry).

A registration names the ``GradSync`` class, its options dataclass and how ``connect``
chooses it (URL schemes, or a selecting option); ``connect``, docs/reference.md's
option tables and ``tests/test_registry.py`` all read them from here. Classes are
``"module:Class"`` strings, so this module imports no backend.
"""

from __future__ import annotations

import importlib
import re
import warnings
from dataclasses import dataclass
from urllib.parse import urlsplit

from ferrosync.errors import ConfigError, redact
from ferrosync_schemes import scheme


@dataclass(frozen=True)
class Registration:
    """One backend, as ``connect`` chooses it and the docs and tests list it."""

    #: the option table's name (``<!-- options:NAME -->``) and the backend's short name
    name: str
    #: ``"module:Class"`` of the ``GradSync`` subclass
    backend: str
    #: ``"module:Class"`` of its ``BackendOptions`` dataclass (``core/options.py``)
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


def _target(obj) -> str:
    """``"module:Class"`` for a class given itself (a string is kept as it is)."""
    return obj if isinstance(obj, str) else f"{obj.__module__}:{obj.__qualname__}"


def register(name: str, *, backend, options, schemes: tuple[str, ...] = (),
             option: str | None = None) -> Registration:
    """Declare a backend (see ``Registration``; ``ferrosync.register_backend``).
    ``backend`` and ``options`` are ``"module:Class"`` strings (imported on first use) or
    the classes. A name, a scheme or a selecting option already taken by another
    registration is a ``ValueError``: ``connect`` must never have two answers for one URL.
    Registering the same thing twice is not an error (a plugin may be found twice)."""
    entry = Registration(name, _target(backend), _target(options), tuple(schemes), option)
    if REGISTRY.get(name) == entry:
        return entry
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

register("storage", backend="ferrosync.storage.sync:StorageSync",
         options="ferrosync.storage.options:StorageOptions")
register("torch", backend="ferrosync.torchdist.sync:TorchDistSync",
         options="ferrosync.torchdist.options:TorchOptions", schemes=("gloo", "nccl", "torch"))
register("hierarchical", backend="ferrosync.torchdist.hierarchical:HierarchicalSync",
         options="ferrosync.torchdist.options:HierarchicalOptions", option="local")
register("elastic", backend="ferrosync.elastic:ElasticSync",
         options="ferrosync.elastic.options:ElasticOptions", option="elastic")


#: a relative path whose first part starts like a URL scheme: ``s3:/bucket/run``,
#: ``s3:bucket``, ``file:/tmp/x`` (a mistyped URL, not a directory named "s3:")
_SCHEME_LIKE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)", re.S)


def split_url(url: str) -> tuple[str, str]:
    """(protocol, rest). A bare path, or ``file://``, is protocol "file".

    For ``file://`` the rest is the path (RFC 8089): ``file:///p`` and
    ``file://localhost/p`` are both ``/p``; any other host is a ``ConfigError`` (ranks
    started in different directories must never read a host name as a relative path).
    A relative path that starts like a URL without its ``//`` (``s3:/bucket/run7``) is
    a ``ConfigError``: read as a directory it would quietly become ``./s3:/bucket/run7``
    (``./s3:/...`` says a directory is meant).

    Credentials written into the URL (``s3://KEY:SECRET@bucket``, found by the one
    redaction rule, ``errors.redact``) are a ``ConfigError`` that shows the URL without
    them: a URL is echoed in process lists, logs, messages and records, so credentials
    belong in ``storage_options`` or the environment. So is a scheme in upper case
    (``S3://``), which fsspec's drivers do not recognise.
    """
    if redact(url) != url:
        raise ConfigError(
            f"{redact(url)}: credentials in a URL are refused (a URL is shown in process "
            "lists, logs and messages)",
            hint="write the URL without them and give them to the store's driver in its "
            "environment (for s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE) or, from Python, in storage_options (on a command line, "
            "--sync-option or --storage-options, they show in process lists too)")
    if "://" not in url:
        mistyped = _SCHEME_LIKE.fullmatch(url)
        if mistyped is not None:
            name, _, rest = mistyped.groups()
            name = name.lower()
            local = scheme(name).protocol == "file"  # file:///abs/path
            fixed = f"{name}://{'/' if local else ''}{rest}"
            raise ConfigError(f"{url!r} looks like a URL without the '//' after its scheme",
                              hint=f"write {fixed} (or ./{url} for a local directory of "
                              "that name)")
        return "file", url
    parts = urlsplit(url)
    written, rest = url.split("://", 1)
    protocol = parts.scheme.lower()
    if written != protocol and written.lower() == protocol:
        raise ConfigError(f"{url!r}: URL schemes are lower case",
                          hint=f"write {protocol}://{rest}")
    if protocol == "file" and not rest.startswith("/"):
        host, slash, path = rest.partition("/")
        if host.lower() != "localhost":
            raise ConfigError(
                f"file:// URL {url!r} names the host {host!r}", path=url,
                hint="ferrosync reads local paths only: write file:///abs/path (or "
                "file://localhost/abs/path), or mount the remote directory and use its "
                "local path")
        rest = slash + path
    return protocol, rest


def _load(target: str):
    module, name = target.split(":")
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


# -- backends of other distributions ----------------------------------------------------------

#: the entry-point group a distribution names its backends in (as fsspec's
#: ``fsspec.specs``): each entry point's value is a ``Registration`` or a callable that
#: registers (calls ``register``)
ENTRY_POINT_GROUP = "ferrosync.backends"

_plugins = {"loaded": False}


def load_entry_points() -> list[str]:
    """Register the backends that installed distributions declare in the
    ``ferrosync.backends`` entry-point group, once per process (``connect`` calls it on
    the first URL or option no registration serves). Returns the entry points
    loaded. One that fails to load is a warning naming it, not an error: a broken plugin
    must not stop the URLs that do not need it."""
    if _plugins["loaded"]:
        return []
    _plugins["loaded"] = True
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            found = ep.load()
            if isinstance(found, Registration):
                register(found.name, backend=found.backend, options=found.options,
                         schemes=found.schemes, option=found.option)
            else:
                found()
        except Exception as exc:  # noqa: BLE001 -- reported, and the others still load
            warnings.warn(f"ferrosync: backend entry point {ep.name!r} ({ep.value}) did "
                          f"not load: {type(exc).__name__}: {exc}; fix or uninstall the "
                          "distribution that declares it", stacklevel=2)
            continue
        loaded.append(ep.name)
    return loaded


def storage_registration() -> Registration:
    """The registration of storage URLs: a backend that composes others (the two-level
    sync meets its node leaders through storage, and takes their options) asks here
    instead of importing it."""
    return next(e for e in REGISTRY.values() if not (e.schemes or e.option))


def storage_backend():
    """The GradSync class of storage URLs (``storage_registration``'s)."""
    return storage_registration().load_backend()


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
    on another backend's URL, or two of them, is a ``ConfigError`` (one answer per URL).
    Installed plugins (``load_entry_points``) are looked at first where the URL's scheme
    is no registration's or an option is one the backend chosen does not take."""
    scheme, _ = split_url(url)
    entry = _choose(url, scheme, options)
    if not _plugins["loaded"] and (
            (scheme != "file" and scheme not in entry.schemes)
            or set(options or ()) - set(entry.load_options().names())):
        load_entry_points()
        entry = _choose(url, scheme, options)
    return entry


def _choose(url: str, scheme: str, options: dict | None) -> Registration:
    chosen = [e for e in REGISTRY.values() if scheme in e.schemes]
    selecting = [e for e in REGISTRY.values() if _selects(e, options)]
    if selecting and (chosen or len(selecting) > 1):
        from ferrosync.errors import ConfigError

        given = " with ".join(f"{e.option}={options[e.option]!r}" for e in selecting)
        raise ConfigError(f"{given} needs a storage URL (a directory or an object store, "
                          f"and no other backend's option), got {url!r}",
                          hint="give one selecting option, with a storage URL")
    return (chosen or selecting or [storage_registration()])[0]


def served_by_storage(url: str) -> bool:
    """Whether ``url`` is a storage URL (a directory or an object store, whatever option
    selects the backend on it), not one of a backend with schemes of its own (``gloo://``,
    a plugin's): what the trainer's launcher checks before any rank starts."""
    return not registration_for(url).schemes


def backend_for(url: str, options: dict | None = None):
    """The GradSync subclass serving ``url`` (validation of the URL itself is its job).

    A storage URL with ``local=...`` gets the two-level backend (nodes reduce locally,
    leaders meet through the storage), one with ``elastic=True`` an elastic job's member.
    """
    return registration_for(url, options).load_backend()


def option_tables() -> dict:
    """Option table name -> options dataclass, one per registration, in order."""
    return {entry.name: entry.load_options() for entry in REGISTRY.values()}
