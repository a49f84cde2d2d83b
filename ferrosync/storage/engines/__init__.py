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
import re
from urllib.parse import urlsplit

from ferrosync.errors import ConfigError, redact
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
]

def opener_of(protocol: str):
    """The engine's opener for ``protocol``, ``opener(url, protocol, rest,
    storage_options, timeout)``, named by the one table of schemes (``ferrosync_schemes``;
    any scheme without a row is an fsspec driver's)."""
    module, _, name = scheme(protocol).opener.partition(":")
    return getattr(importlib.import_module(module), name)


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


def open_storage(url: str, storage_options: dict | None = None, *,
                 timeout: float | None = None, transfer: dict | None = None) -> Storage:
    """Storage for ``url``. Validates the URL; does no I/O on object stores yet.

    ``timeout`` (seconds; ``connect``'s) bounds the first contact with an object
    store (``probe_bucket``), the retries of any one call (``Storage.retry_s``) and,
    on S3, botocore's own connect/read timeouts and retries, so a dead or mistyped
    endpoint fails within it. A missing fsspec driver is a ``ConfigError`` with the
    ``pip install`` that adds it. ``transfer``: ``Storage.set_transfer``'s settings
    (an object store's largest request, part size and parts in flight).
    """
    protocol, rest = split_url(url)
    storage = opener_of(protocol)(url, protocol, rest, dict(storage_options or {}), timeout)
    storage.retry_s = timeout  # a call's retries end within it
    storage.set_transfer(**(transfer or {}))
    return storage
