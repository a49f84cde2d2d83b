"""The ``init_method`` handlers of ``init_process_group("ferrosync", ...)``: where the
ranks meet.

A bare path, a ``file://`` directory, an object-store URL and ``env://`` without
``MASTER_ADDR`` are taken over (the cases torch itself rejects); everything else keeps
torch's meaning. ``location_of`` reads the storage location back from torch's store.
URLs and what each gives: docs/ddp.md#init_method. Which URLs reach these handlers is
the registrar's (``ferrosync_autoload``), which this module never imports.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import parse_qsl, urlsplit

import torch.distributed as dist

from ferrosync.core.env import ENV_URL, discover
from ferrosync.errors import ConfigError, StorageError
from ferrosync.storage.engines.local import DIR_MODE, file_kind

#: torch's FileStore inside a directory init_method (ferrosync's own files sit beside it)
STORE_FILE = "c10d.store"
#: data directory next to a FileStore *file* named by a ``file://`` init_method
FILE_DATA_SUFFIX = ".ferrosync"

ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"

_IDENTITY_KEYS = ("rank", "world_size")
# torch keeps only the C++ half of a Python store alive; without this reference the
# UrlStore (and its URL) would be collected while its process group still uses it
_LIVE_URL_STORES: list[_LocalStore] = []


class _LocalStore(dist.Store):
    """A store shared with no other rank, for init_methods whose ranks meet in storage.

    Keys set in this process can be read back (torch sets a few of its own); a key
    that would have to come from another rank raises ``ConfigError`` at once
    instead of waiting out a timeout, because nothing is shared between hosts.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self._data: dict[str, bytes] = {}

    def _what(self) -> str:
        raise NotImplementedError

    def _hint(self) -> str:
        raise NotImplementedError

    def _missing(self, keys) -> ConfigError:
        return ConfigError(
            f"{self._what()} has no key-value store shared between ranks, but "
            f"{list(keys)} was asked for (another backend, or TORCH_DIST_INIT_BARRIER=1?)",
            rank=self.rank, hint=self._hint(),
        )

    def set(self, key, value) -> None:
        self._data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key) -> bytes:
        if key not in self._data:
            raise self._missing([key])
        return self._data[key]

    def add(self, key, amount) -> int:
        value = int(self._data.get(key, b"0")) + int(amount)
        self._data[key] = str(value).encode()
        return value

    def compare_set(self, key, expected, desired) -> bytes:
        current = self._data.get(key)
        expected = expected if isinstance(expected, bytes) else str(expected).encode()
        if (current is None and not expected) or current == expected:
            self.set(key, desired)
        return self._data.get(key, expected)

    def check(self, keys) -> bool:
        return all(k in self._data for k in keys)

    def wait(self, keys, timeout=None) -> None:
        if not self.check(keys):
            raise self._missing([k for k in keys if k not in self._data])

    def delete_key(self, key) -> bool:
        return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._data)


class UrlStore(_LocalStore):
    """The "store" behind an object-store init_method: it only carries the URL."""

    def __init__(self, url: str, rank: int) -> None:
        super().__init__(rank)
        self.url = url

    def _what(self) -> str:
        return f"init_method {self.url!r}"

    def _hint(self) -> str:
        return ("use an object-store init_method only with backend='ferrosync'; for gloo or "
                "nccl use tcp://, env:// or a shared directory")


class EnvStore(_LocalStore):
    """The "store" behind ``env://`` without ``MASTER_ADDR`` but with ``$FERROSYNC_URL``.

    It names no location (``location_of`` returns None), so the backend finds its
    location where it would for ``env://`` with a TCPStore: ``pg_options["url"]``,
    else ``$FERROSYNC_URL``.
    """

    def _what(self) -> str:
        return f"env:// without {ENV_MASTER_ADDR} (ranks meeting through ${ENV_URL})"

    def _hint(self) -> str:
        return (f"set {ENV_MASTER_ADDR} and {ENV_MASTER_PORT} (torchrun and python -m "
                "ferrosync.train do) for backends other than 'ferrosync'")


def _innermost(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def is_shared_store(store) -> bool:
    """Whether ``store`` reaches the other ranks (not a process-local ``UrlStore`` or
    ``EnvStore``, which init_methods make where the ranks meet in storage only)."""
    return not isinstance(_innermost(store), _LocalStore)


def location_of(store) -> str | None:
    """The storage URL an init_method stands for, from the store torch built for it.

    Returns None when the store says nothing about a location (``env://``,
    ``tcp://`` or an explicit ``store=``); the caller then needs another source.
    """
    inner = _innermost(store)
    if isinstance(inner, UrlStore):
        return inner.url
    if isinstance(inner, dist.FileStore):
        path = inner.path
        if os.path.basename(path) == STORE_FILE:
            return os.path.dirname(path)
        return path + FILE_DATA_SUFFIX
    return None


def _identity(query: str, url: str):
    """(rank, world_size) from the query torch appended, else from the environment."""
    pairs = dict(parse_qsl(query, keep_blank_values=True))
    extra = sorted(set(pairs) - set(_IDENTITY_KEYS))
    if extra:
        raise ConfigError(
            f"init_method {url!r} has query parameters {extra}; only rank and world_size "
            "are understood",
            hint="pass ferrosync options through pg_options={...} or the "
            "FERROSYNC_PG_OPTIONS environment variable (JSON)",
        )
    values = {}
    for key in _IDENTITY_KEYS:
        raw = pairs.get(key)
        try:
            value = None if raw is None else int(raw)
        except ValueError:
            raise ConfigError(f"init_method {url!r}: {key}={raw!r} is not an integer") from None
        values[key] = None if value is None or value < 0 else value  # torch's -1: not given
    identity = discover(values["rank"], values["world_size"])
    return identity.rank, identity.world_size


def _directory_store(path: str, world_size: int) -> dist.FileStore:
    """torch's FileStore inside ``path``, which is made owner-and-group only (DIR_MODE),
    like every directory ferrosync creates."""
    os.makedirs(path, DIR_MODE, exist_ok=True)
    store_file = os.path.join(path, STORE_FILE)
    _refuse_special(store_file)
    return dist.FileStore(store_file, world_size)


def _refuse_special(path: str) -> None:
    """torch opens the store file itself, following links: refuse a link or special
    file planted at its name first (a best effort: torch's own open is not ours)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise StorageError(
            f"{file_kind(mode)} occupies the store file's name where a regular file (or "
            "nothing) belongs; refused", path=path,
            hint="remove it, find out who put it there, and give the job a directory "
            "only its own user (or group) can write",
        )


def local_handler(url: str, **kwargs):
    """A bare path: a directory (created if missing), or an existing store file."""
    parts = urlsplit(url)
    rank, world_size = _identity(parts.query, url)
    if not parts.path:
        raise ConfigError(f"init_method {url!r} names no path")
    path = os.path.abspath(os.path.expanduser(parts.path))
    if os.path.isfile(path):  # an existing FileStore file, as file:// would take it
        store = dist.FileStore(path, world_size)
    else:
        store = _directory_store(path, world_size)
    yield store, rank, world_size
    raise RuntimeError(f"init_method {url!r} cannot re-rendezvous")


def file_handler(url: str, **kwargs):
    """``file://`` naming a directory (which torch's own handler rejects)."""
    parts = urlsplit(url)
    rank, world_size = _identity(parts.query, url)
    yield _directory_store(parts.path, world_size), rank, world_size
    raise RuntimeError(f"init_method {url!r} cannot re-rendezvous")


def env_handler(url: str, **kwargs):
    """``env://`` without ``MASTER_ADDR`` but with ``$FERROSYNC_URL``: a process-local
    ``EnvStore`` (see the module docstring)."""
    parts = urlsplit(url)
    # torch's own env:// query parameter; meaningless without a TCPStore
    query = "&".join(p for p in parts.query.split("&") if not p.startswith("use_libuv="))
    rank, world_size = _identity(query, url)
    store = EnvStore(rank)
    _LIVE_URL_STORES.append(store)
    yield store, rank, world_size
    raise RuntimeError(f"init_method {url!r} cannot re-rendezvous")


def object_store_handler(url: str, **kwargs):
    """``scheme://bucket/prefix``: a process-local ``UrlStore`` carrying the URL."""
    parts = urlsplit(url)
    rank, world_size = _identity(parts.query, url)
    if not parts.netloc:
        raise ConfigError(f"init_method {url!r} names no bucket",
                          hint="use scheme://bucket/prefix")
    store = UrlStore(f"{parts.scheme}://{parts.netloc}{parts.path}", rank)
    _LIVE_URL_STORES.append(store)
    yield store, rank, world_size
    raise RuntimeError(f"init_method {url!r} cannot re-rendezvous")
