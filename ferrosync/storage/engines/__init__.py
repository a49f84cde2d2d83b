"""The storage engines: one small interface (``Storage``) over a shared directory or an
fsspec object store, one engine per module, chosen by ``open_storage`` from the URL's
scheme (``ferrosync_schemes.SCHEMES``).

The interface (put, open, read, delete, makedirs, list, read_head) and the rules every
engine keeps: docs/design.md#storage-rules (atomic publish, exact names and never
``exists()``, counting every request) and docs/design.md#security-model (below the root
nothing is followed). Modules: ``base``, ``classify``, ``local``, ``local_tools``,
``fsspec_store``, ``s3``, ``mounts``, ``parts``.
"""

from __future__ import annotations

import importlib
import os

from ferrosync.core.registry import split_url
from ferrosync.storage.engines.base import (
    RECORD_LIMIT,
    REQUEST_KINDS,
    Backoff,
    BytesReader,
    Counters,
    ExclusiveCreateUnsupported,
    Reader,
    Storage,
    object_exists,
    oversized,
    probe_location,
)
from ferrosync.storage.engines.fsspec_store import FsspecStorage, gcs_driver
from ferrosync.storage.engines.local import LocalStorage
from ferrosync.storage.engines.mounts import LOCAL_FILESYSTEMS, is_local_filesystem, mount_of
from ferrosync_schemes import scheme

__all__ = [
    "Storage", "LocalStorage", "FsspecStorage", "open_storage", "Counters", "Backoff",
    "object_exists", "probe_location", "mount_of", "is_local_filesystem", "LOCAL_FILESYSTEMS",
    "ExclusiveCreateUnsupported", "gcs_driver", "RECORD_LIMIT",
    "REQUEST_KINDS", "Reader", "BytesReader", "oversized", "split_url", "opener_of",
    "ENV_FAULTS",
]

def opener_of(protocol: str):
    """The engine's opener for ``protocol``, ``opener(url, protocol, rest,
    storage_options, timeout)``, named by the one table of schemes (``ferrosync_schemes``;
    any scheme without a row is an fsspec driver's)."""
    module, _, name = scheme(protocol).opener.partition(":")
    return getattr(importlib.import_module(module), name)


def open_storage(url: str, storage_options: dict | None = None, *,
                 timeout: float | None = None, transfer: dict | None = None,
                 rank=None) -> Storage:
    """Storage for ``url``. Validates the URL; does no I/O on object stores yet.

    ``timeout`` (seconds; ``connect``'s) bounds the first contact with an object
    store (``probe_bucket``), the retries of any one call (``Storage.retry_s``) and,
    on S3, botocore's own connect/read timeouts and retries, so a dead or mistyped
    endpoint fails within it. A missing fsspec driver is a ``ConfigError`` with the
    ``pip install`` that adds it. ``transfer``: ``Storage.set_transfer``'s settings
    (an object store's largest request, part size and parts in flight). ``rank``: the
    rank whose collectives use this storage (an int, or a function returning an
    elastic member's rank of the moment); None for anyone else (tools, checkpoints).
    A rank's storage takes the faults ``$FERROSYNC_FAULTS`` names (``FAULT_LAYER``).
    """
    protocol, rest = split_url(url)
    storage = opener_of(protocol)(url, protocol, rest, dict(storage_options or {}), timeout)
    storage.retry_s = timeout  # a call's retries end within it
    storage.set_transfer(**(transfer or {}))
    return _with_faults(storage, rank)


#: names the faults a test or drill injects into a rank's storage (JSON, see
#: ``ferrosync.testing.faults``); read here only
ENV_FAULTS = "FERROSYNC_FAULTS"
#: the storage-level fault layer, named like an opener: imported only when
#: ``$FERROSYNC_FAULTS`` is set (``ferrosync.testing`` sits above storage)
FAULT_LAYER = "ferrosync.testing.faults:inject"


def _with_faults(storage: Storage, rank) -> Storage:
    """``storage`` wrapped in the fault layer (``FAULT_LAYER``) where ``$FERROSYNC_FAULTS``
    is set and ``storage`` is a rank's; else ``storage`` itself. The one hook of fault
    injection: the production path pays one environment lookup per storage opened."""
    spec = os.environ.get(ENV_FAULTS)
    if not spec or rank is None:
        return storage
    module, _, name = FAULT_LAYER.partition(":")
    return getattr(importlib.import_module(module), name)(storage, rank, spec)
