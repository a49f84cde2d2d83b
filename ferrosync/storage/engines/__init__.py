"""One small interface over a shared directory or an fsspec object store.

A backend needs five things from storage, and this package gives exactly those (and
the operator tools a sixth):

* ``put(key, parts)``: publish an object atomically (readers see all of it or none);
* ``open(key)``: a reader for the object, or ``None`` when it does not exist *yet*;
* ``delete(keys)``: remove objects (missing ones are fine);
* ``makedirs(prefix)``: make a "directory" where the store has them;
* ``list(prefix)``: for operator tools only, never on the collective path;
* ``read_head(key, n)``: the first ``n`` bytes of an object (a header, for the tools;
  an exclusive create's own bytes, read back).

Rules kept here (docs/design.md#storage-rules):

* **Atomic publish.** Locally (and on NFS) the bytes go to a temporary file *in the
  same directory*, then ``os.replace`` renames it onto the final name; a rename
  within a directory is atomic on POSIX and on NFS. fsspec's own ``mv`` and
  transactions stage in the system temp dir and silently degrade to a copy across
  filesystems, so they are not used. On object stores one PUT is atomic; an object
  larger than a part is written as part objects and then a manifest at its name
  (``parts``), which is invisible until that last PUT.
* **Exact names, no ``exists()``.** ``open`` asks for one exact name; only "not found"
  means "not yet", every other error propagates at once. (``exists()`` turns a
  permission or network error into "no", and a listing can be stale for seconds
  on NFS or cached by fsspec.) On NFS, ``open()`` of the exact name revalidates
  with the server (close-to-open consistency); mount with ``lookupcache=positive``
  so a cached "no such file" does not hide a new file.
* **Counting.** Every request is counted (``requests``) with the bytes moved, so
  users see what a run costs on a billed object store.
* **The directory is untrusted input.** Anyone who can write to a shared directory
  can plant a symbolic link, a hard link, a FIFO or a directory at a name a rank
  will open. Below the root, LocalStorage never follows a link (``O_NOFOLLOW``, and
  directories are opened with ``O_DIRECTORY|O_NOFOLLOW`` and used through
  ``dir_fd``), never blocks in ``open`` (``O_NONBLOCK``; a FIFO would wait for a
  writer past every timeout), refuses anything but a regular file with a
  ``StorageError``, and rewrites a parked spare only when it is a regular file of
  this uid with one link. Links in the path *to* the root are the user's business.

One engine per module, chosen by ``open_storage`` from the URL's scheme (the one table of
schemes, ``ferrosync_schemes.SCHEMES``: opener, fsspec protocol, install hint, store):
``base`` (the interface, counters, readers, retry, the location probe), ``classify``
(transient or not), ``local`` (directories), ``local_tools`` (what only the operator tools
do to a directory), ``fsspec_store`` (object stores), ``s3`` (S3 specifics), ``mounts``
(which filesystem holds a path) and ``parts`` (object-store objects larger than a part).
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
