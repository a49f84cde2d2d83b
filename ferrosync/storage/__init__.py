"""One small interface over a shared directory or an fsspec object store.

A backend needs five things from storage, and this module gives exactly those:

* ``put(key, parts)``: publish an object atomically (readers see all of it or none);
* ``open(key)``: a reader for the object, or ``None`` when it does not exist *yet*;
* ``delete(keys)``: remove objects (missing ones are fine);
* ``makedirs(prefix)``: make a "directory" where the store has them;
* ``list(prefix)``: for operator tools only, never on the collective path.

Rules kept here (docs/design.md#storage-rules):

* **Atomic publish.** Locally (and on NFS) the bytes go to a temporary file *in the
  same directory*, then ``os.replace`` renames it onto the final name; a rename
  within a directory is atomic on POSIX and on NFS. fsspec's own ``mv`` and
  transactions stage in the system temp dir and silently degrade to a copy across
  filesystems, so they are not used. On object stores one PUT is atomic (s3fs
  switches to a multipart upload above 100 MiB, which is invisible until complete).
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
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import secrets
import stat
import threading
import time
from typing import Iterable, Sequence
from urllib.parse import urlsplit

from . import names
from .errors import ConfigError, FerrosyncError, ShardCorrupt, StorageError

__all__ = [
    "Storage", "LocalStorage", "FsspecStorage", "open_storage", "Counters", "Backoff",
    "object_exists", "probe_location", "mount_of", "is_local_filesystem", "LOCAL_FILESYSTEMS",
    "ExclusiveCreateUnsupported", "gcs_driver", "RECORD_LIMIT",
]

#: the largest control record (rendezvous, heartbeat, abort marker, layout, error
#: record): ``Storage.read``'s default bound. A larger object at such a name is not
#: ferrosync's (planted, or a sparse file), and is refused before it is read.
RECORD_LIMIT = 1 << 20

# File and directory modes: owner and group only, never world-accessible (the
# umask may remove more). Group access lets ranks run under different users of
# one group on a shared NFS export.
FILE_MODE = 0o660
DIR_MODE = 0o770

# errno values that mean "try the same request again": NFS stale handles after
# a concurrent rename, interrupted calls, brief server hiccups.
_TRANSIENT_ERRNOS = {errno.ESTALE, errno.EINTR, errno.EAGAIN, errno.EIO, errno.ETIMEDOUT}
_PERMANENT_HINTS = {
    errno.ENOSPC: "the storage is full: free space or point the URL elsewhere",
    errno.EDQUOT: "the disk quota is exceeded: free space or raise the quota",
    errno.EACCES: "permission denied: check the directory's owner and mode",
    errno.EPERM: "operation not permitted: check the directory's owner and mode",
    errno.EROFS: "the filesystem is read-only: mount it read-write",
}
# errno values that mean "something other than a regular file (or a directory, for a
# key's directory) occupies this name": ELOOP from O_NOFOLLOW on a link (EMLINK and
# EFTYPE on the BSDs), ENXIO from a socket or a FIFO without a reader, EISDIR and
# ENOTDIR from a directory where a file belongs or the reverse
_OCCUPIED_ERRNOS = {errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR, errno.ENOTDIR,
                    getattr(errno, "EFTYPE", errno.ELOOP)}
_OCCUPIED_HINT = ("ferrosync never follows links or opens special files inside its "
                  "directory: remove it, find out who or what put it there, and give every "
                  "job a directory only its own user (or group) can write")


def check_key(key: str) -> str:
    """Keys are relative POSIX paths below the root: no escapes, no surprises."""
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or "\0" in key or any(
        p in ("", ".", "..") for p in parts
    ):
        raise ConfigError(f"invalid storage key {key!r}",
                          hint="keys are relative paths without '..', '.' or empty parts")
    return key


def oversized(path: str, size: int | None, max_bytes: int, rank: int | None) -> ShardCorrupt:
    """The error for an object larger than any legal object of its kind (``size``
    None: its size is not known, only that it is larger)."""
    has = "is larger than" if size is None else f"has {size} bytes, more than"
    return ShardCorrupt(
        f"object {has} the {max_bytes} bytes an object of this kind can have (a planted "
        "or sparse file, or not ferrosync's); refused unread",
        rank=rank, path=path,
        hint="remove it, find out who or what wrote it, and give every job a location "
        "only its own ranks can write (and a secret, FERROSYNC_SECRET)")


#: request kinds an object store bills differently (``costs.py``); ``requests`` counts
#: every request, of these kinds or not (local file-system calls have no kind)
REQUEST_KINDS = ("puts", "gets", "deletes", "lists")


class Counters:
    """Thread-safe request and byte counters (the heartbeat thread also counts)."""

    __slots__ = ("_lock", "requests", "bytes_written", "bytes_read", "objects_written",
                 *REQUEST_KINDS)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.objects_written = 0
        self.puts = self.gets = self.deletes = self.lists = 0

    def add(self, requests: int = 0, written: int = 0, read: int = 0, objects: int = 0, *,
            puts: int = 0, gets: int = 0, deletes: int = 0, lists: int = 0) -> None:
        """Count ``requests`` of no particular kind plus requests of each billed kind
        (which count in ``requests`` too), bytes and collective objects."""
        with self._lock:
            self.requests += requests + puts + gets + deletes + lists
            self.bytes_written += written
            self.bytes_read += read
            self.objects_written += objects
            self.puts += puts
            self.gets += gets
            self.deletes += deletes
            self.lists += lists

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": self.requests,
                "bytes_written": self.bytes_written,
                "bytes_read": self.bytes_read,
                "objects_written": self.objects_written,
                **{kind: getattr(self, kind) for kind in REQUEST_KINDS},
            }


class Reader:
    """Sequential reader of one stored object. ``readinto`` fills a buffer fully.

    Local readers read straight into the caller's buffer (no intermediate copy);
    object-store readers hold the one GET's bytes and copy out of them.
    """

    size: int

    def readinto(self, buf) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _FdReader(Reader):
    def __init__(self, fd: int, path: str, counters: Counters, size: int) -> None:
        self._fd = fd
        self._path = path
        self._counters = counters
        self.size = size  # from the fstat that checked the file is regular

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        total = 0
        try:
            while total < len(view):
                n = os.readv(self._fd, [view[total:]])
                if n == 0:
                    break
                total += n
        except OSError as exc:
            raise _storage_error("reading", self._path, exc, _is_transient(exc)) from exc
        finally:
            self._counters.add(read=total)
        return total

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _BytesReader(Reader):
    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0
        self.size = len(data)

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = min(len(view), len(self._data) - self._pos)
        view[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._data.release()


class Storage:
    """Base class: the counters, retries and the interface every store implements."""

    #: polling back-off for this kind of store: (first sleep, cap), seconds
    poll_initial: float = 50e-6
    poll_max: float = 0.02
    #: heartbeat period that keeps request counts sane on this kind of store
    heartbeat_interval: float = 1.0
    retries: int = 4

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.counters = Counters()

    # -- interface -----------------------------------------------------------------
    def probe_bucket(self) -> None:
        """Raise ``ConfigError`` if the store's container (an object store's bucket) is
        missing or unreachable; a directory has none to check."""

    #: whether ``put(..., reuse=old_key)`` can recycle an old object's storage
    can_recycle: bool = False
    #: deleting costs microseconds (local files, memory), not a billed round trip
    cheap_deletes: bool = False
    #: every request is a network round trip (object stores): a collective with fewer
    #: requests in sequence beats one that moves fewer bytes (``reduce="auto"``)
    round_trips_dominate: bool = False

    def put(self, key: str, parts: Sequence, *, exclusive: bool = False,
            reuse: str | None = None) -> int:
        """Publish ``parts`` (buffers, concatenated) under ``key`` atomically.

        With ``exclusive`` the put fails with ``FileExistsError`` when ``key`` exists
        (used for write-once announcements). ``reuse`` names an object in the same
        directory that the caller owns and that nobody will read again: where
        ``can_recycle`` is true its storage is rewritten instead of allocating a new
        object (and it disappears under its old name); elsewhere it is ignored.
        Returns the bytes written.
        """
        raise NotImplementedError

    def open(self, key: str, *, max_bytes: int | None = None,
             rank: int | None = None) -> Reader | None:
        """A reader for ``key``, or None if it does not exist (the only "not yet").

        With ``max_bytes`` (the largest legal object of the kind the caller expects),
        a larger object raises ``ShardCorrupt`` naming ``rank`` and the path before
        any of it is read or buffered: storage's claimed size is checked first, and an
        object store is asked for at most ``max_bytes + 1`` bytes. Without it, a local
        reader streams (the caller checks ``size`` against what it expects before
        reading), while an object store's reader holds the whole object.
        """
        raise NotImplementedError

    def read(self, key: str, *, max_bytes: int | None = RECORD_LIMIT,
             rank: int | None = None) -> bytes | None:
        """The whole object, or None if it does not exist.

        Bounded by default to a control record's limit (``RECORD_LIMIT``): a larger
        object is ``ShardCorrupt`` (see ``open``) after O(1) memory and one request.
        A caller reading a bigger kind passes the largest legal size of that kind, or
        ``max_bytes=None`` only where the bytes come from a trusted place.
        """
        reader = self.open(key, max_bytes=max_bytes, rank=rank)
        if reader is None:
            return None
        with reader:
            buf = bytearray(reader.size)
            n = reader.readinto(buf)
            return bytes(buf[:n])

    def _check_size(self, key: str, size: int, max_bytes: int | None,
                    rank: int | None) -> None:
        """Refuse an object larger than the largest legal one of its kind."""
        if max_bytes is not None and size > max_bytes:
            raise oversized(self.path_of(key), size, max_bytes, rank)

    def delete(self, keys: Iterable[str]) -> None:
        raise NotImplementedError

    def park(self, key: str) -> str | None:
        """Move a consumed object to a hidden spare name for a later ``put(reuse=...)``.

        Returns the spare's key, or None where the store cannot recycle (the object is
        then left alone: delete it instead).
        """
        return None

    def makedirs(self, prefix: str) -> None:
        """Create a directory level where the store has them; no-op on object stores."""

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """(key, size) of objects below ``prefix``; for tools, never the hot path."""
        raise NotImplementedError

    def path_of(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def close(self) -> None:
        pass

    # -- shared helpers ------------------------------------------------------------
    def _retry(self, what: str, key: str, fn, *args, **kwargs):
        """Run ``fn``; retry transient failures with bounded exponential back-off.

        "Not found" (FileNotFoundError) and FileExistsError are answers, not failures,
        and pass straight through; so do permanent errors, wrapped with the path
        and a hint so the caller can say what to do (a StorageError ``fn`` raised
        itself already says it).
        """
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, FileExistsError, StorageError):
                raise
            except Exception as exc:  # botocore/aiohttp errors are not all OSErrors
                transient = _is_transient(exc)
                if not transient or attempt == self.retries:
                    raise _storage_error(what, self.path_of(key), exc, transient) from exc
                self._recover()
                time.sleep(delay)
                delay = min(delay * 4, 2.0)
        raise AssertionError("unreachable")

    def _recover(self) -> None:
        """Before retrying a transient failure: drop state the failure may have made
        stale (LocalStorage: directory handles of removed directories)."""


# Object-store answers that mean "busy or hiccuped: the same request may succeed":
# S3 error codes (botocore ``ClientError.response["Error"]["Code"]``) and HTTP statuses
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"}
_TRANSIENT_STATUSES = {500, 503}
# S3 error codes that mean "these credentials may not do this"
_DENIED_CODES = {"AccessDenied"}


def _client_transient_types() -> tuple[type, ...]:
    """The object-store clients' connection failures that are not ``OSError``s with a
    transient errno: botocore's (for s3fs) and aiohttp's (s3fs, gcsfs, http), where
    installed. Imported lazily: a local-only install has neither."""
    found: list[type] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    try:
        from botocore.exceptions import (
            ConnectionClosedError,
            EndpointConnectionError,
            ReadTimeoutError,
        )
        found += [ConnectionClosedError, EndpointConnectionError, ReadTimeoutError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientOSError, ServerDisconnectedError
        found += [ClientOSError, ServerDisconnectedError]
    except ImportError:
        pass
    return tuple(found)


_TRANSIENT_TYPES: tuple[type, ...] | None = None


def _causes(exc: BaseException | None, depth: int = 8):
    """``exc`` and what it was raised from or while handling (s3fs and gcsfs raise an
    ``OSError`` whose cause is the client's error), nearest first."""
    for _ in range(depth):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def _s3_response(exc: BaseException) -> dict | None:
    """The botocore response dict behind ``exc`` (a ``ClientError``'s), or None."""
    for cause in _causes(exc):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            return response
    return None


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind ``exc`` ("SlowDown", "AccessDenied", ...), or None."""
    code = ((_s3_response(exc) or {}).get("Error") or {}).get("Code")
    return code if isinstance(code, str) else None


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc``: botocore's response metadata, or the attribute
    the other clients name it by (aiohttp ``status``, azure ``status_code``, gcsfs
    ``code``)."""
    response = _s3_response(exc)
    if response is not None:
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    for cause in _causes(exc):
        for name in ("status", "status_code", "code"):
            status = getattr(cause, name, None)
            if isinstance(status, int) and not isinstance(status, bool):
                return status
    return None


def _is_transient(exc: BaseException) -> bool:
    """Whether the same request may succeed if tried again, judged by type, errno,
    S3 error code and HTTP status only. Messages are never searched: their wording is
    no contract, and a path or bucket name may contain any word or number."""
    global _TRANSIENT_TYPES
    if _TRANSIENT_TYPES is None:
        _TRANSIENT_TYPES = _client_transient_types()
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    # the client's answer behind a translated error (s3fs: an OSError caused by it)
    return _s3_code(exc) in _TRANSIENT_CODES or _http_status(exc) in _TRANSIENT_STATUSES


def _storage_error(what: str, path: str, exc: BaseException, transient: bool) -> StorageError:
    hint = None
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_HINTS:
        hint = _PERMANENT_HINTS[exc.errno]
    elif isinstance(exc, PermissionError) or _s3_code(exc) in _DENIED_CODES or (
            _http_status(exc) == 403):
        hint = "access denied: check the credentials and the bucket policy"
    elif transient:
        hint = "the storage kept failing after retries: check that it is reachable"
    cause = f"{type(exc).__name__}: {exc}"
    return StorageError(f"{what} failed ({cause})", path=path, hint=hint)


# How LocalStorage opens names below its root (see "The directory is untrusted input").
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
#: a directory handle used only as ``dir_fd``: O_PATH (Linux) needs search permission
#: only, as the path lookups it replaces did, not read permission
_HANDLE = getattr(os, "O_PATH", os.O_RDONLY)
#: the root itself: links on the user's path to it are followed
_ROOT_FLAGS = _HANDLE | _O_DIRECTORY | _CLOEXEC
#: a directory below the root: a link there is refused (ENOTDIR)
_DIR_FLAGS = _HANDLE | _O_DIRECTORY | _NOFOLLOW | _CLOEXEC
#: a directory to list (scandir reads it), below or at the root: no link either
_LIST_FLAGS = os.O_RDONLY | _O_DIRECTORY | _NOFOLLOW | _CLOEXEC
#: an object to read: no link, and no waiting in open() for a FIFO's writer; fstat
#: then refuses whatever is not a regular file
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
#: a temporary file: created now, so never an existing name or a link's target
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
#: a parked spare to rewrite, and the gc lock: checked with fstat once open
_REUSE_FLAGS = os.O_WRONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
#: how often (s) a miss checks whether a cached directory was removed meanwhile
_GONE_CHECK_PERIOD = 1.0


class _Dir:
    """An open directory below (or at) the root.

    The descriptor closes when the last user lets go of this object, so a handle one
    thread drops from the cache is never closed (and its number reused for another
    file) under an operation another thread is running with it.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def gone(self) -> bool:
        """True once the directory was removed (or its NFS handle went stale)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except Exception:  # noqa: BLE001 - at interpreter exit even ``os`` may be gone
            pass


class LocalStorage(Storage):
    """A directory on a local or network (NFS) filesystem.

    Every name below the root is reached through an open handle of its directory
    (``dir_fd``), opened once without following links and then kept: a link planted
    in place of ``rdzv`` or a generation directory is refused, and the data path
    makes no more system calls than plain paths would (fewer lookups, in fact).
    """

    poll_initial = 20e-6
    poll_max = 0.01
    heartbeat_interval = 1.0
    cheap_deletes = True

    def __init__(self, root: str, *, recycle: bool | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root)
        self.root = root
        self._made: set[str] = set()
        self._dirs: dict[str, _Dir] = {}
        self._dirs_lock = threading.Lock()
        self._next_gone_check = 0.0
        # Rewriting a consumed file in place skips the kernel zeroing fresh page-cache
        # pages (32 MiB: 5 ms instead of 15 ms on tmpfs). Only on local filesystems: an
        # NFS client may hold cached pages of the old contents under the same inode.
        self.can_recycle = is_local_filesystem(root) if recycle is None else bool(recycle)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key)) if key else self.root

    # -- directory handles ---------------------------------------------------------------
    def _dir(self, directory: str) -> _Dir:
        """The handle of ``directory`` ("" is the root), opened on first use.

        FileNotFoundError when it does not exist (yet); StorageError when a link, a
        file or anything else but a directory holds its name.
        """
        handle = self._dirs.get(directory)
        if handle is None:
            handle = self._open_dir(directory)
        return handle

    def _open_dir(self, directory: str) -> _Dir:
        if directory:
            parent, _, name = directory.rpartition("/")
            parent_fd = self._dir(parent).fd
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
            except OSError as exc:
                if exc.errno in _OCCUPIED_ERRNOS:
                    raise _occupied(self._path(directory), parent_fd, name,
                                    expected="a directory") from None
                raise
        else:
            try:
                fd = os.open(self.root, _ROOT_FLAGS)
            except NotADirectoryError:
                raise StorageError("the storage location is not a directory", path=self.root,
                                   hint="pass a directory (or a path to create) as the URL"
                                   ) from None
        handle = _Dir(fd)
        with self._dirs_lock:
            # a racing thread's handle wins; ours closes when dropped
            return self._dirs.setdefault(directory, handle)

    def _locate(self, key: str) -> tuple[_Dir, str]:
        """(handle of ``key``'s directory, the last part of ``key``)."""
        directory, _, name = check_key(key).rpartition("/")
        return self._dir(directory), name

    def _forget_gone(self, force: bool = True) -> bool:
        """Drop the handles of directories removed since they were opened (deleted,
        or deleted and made again: the next use then opens the new one by name).
        Returns whether any was dropped. Unforced, it runs at most once a period: a
        reader polling for a missing object must not stat every directory each time.
        """
        now = time.monotonic()
        if not force and now < self._next_gone_check:
            return False
        self._next_gone_check = now + _GONE_CHECK_PERIOD
        with self._dirs_lock:
            gone = [d for d, handle in self._dirs.items() if handle.gone()]
            for directory in gone:
                del self._dirs[directory]
                self._made.discard(directory)
        return bool(gone)

    def _recover(self) -> None:
        self._forget_gone()

    def close(self) -> None:
        with self._dirs_lock:
            self._dirs.clear()  # each descriptor closes once no operation holds it

    # -- the interface -------------------------------------------------------------------
    def makedirs(self, prefix: str) -> None:
        if prefix in self._made:
            return
        if "" not in self._made:
            # the root and its parents by path: links on the way there are the user's
            try:
                self._retry("creating the directory", "", os.makedirs, self.root, DIR_MODE,
                            True)
            except FileExistsError:
                raise StorageError("the storage location is not a directory", path=self.root,
                                   hint="pass a directory (or a path to create) as the URL"
                                   ) from None
            self._dir("")
            self._made.add("")
        parent = ""
        for part in check_key(prefix).split("/") if prefix else ():
            here = f"{parent}/{part}" if parent else part
            self._retry("creating the directory", here, _mkdir_at, part, self._dir(parent).fd)
            self._dir(here)  # refuses a link or a file found at the name
            parent = here
        self._made.add(prefix)

    def put(self, key: str, parts: Sequence, *, exclusive: bool = False,
            reuse: str | None = None) -> int:
        try:
            return self._put(key, parts, exclusive, reuse)
        except FileNotFoundError as exc:
            if not self._forget_gone():
                raise self._vanished(key) from exc
        try:  # the directory was removed, and perhaps made again: once more, by name
            return self._put(key, parts, exclusive, reuse)
        except FileNotFoundError as exc:
            raise self._vanished(key) from exc

    def _put(self, key: str, parts: Sequence, exclusive: bool, reuse: str | None) -> int:
        handle, name = self._locate(key)
        # The temporary name lives in the *same directory* so the rename is atomic;
        # names.temp hides it and marks it for `gc` if this process dies here.
        tmp = names.temp(name)
        spare = [None]
        if reuse is not None and self.can_recycle:
            spare[0] = self._adopt_spare(handle, key, reuse, tmp)
            if spare[0] is None:
                tmp = names.temp(name)  # whatever held the spare's name may still hold tmp

        def write() -> int:
            fd, spare[0] = spare[0], None  # a retry after a failure writes a fresh file
            return _write_file(tmp, parts, dir_fd=handle.fd, fd=fd)

        nbytes = self._retry("writing", key, write)
        try:
            self._retry("publishing", key, self._publish, handle, tmp, name, key, exclusive)
        except BaseException:
            _unlink_quietly(tmp, handle.fd)
            raise
        self.counters.add(requests=1, written=nbytes)
        return nbytes

    def _adopt_spare(self, handle: _Dir, key: str, reuse: str, tmp: str) -> int | None:
        """Rename the parked spare ``reuse`` to ``tmp`` and open it for rewriting; None
        means "write a fresh file instead".

        Only a regular file of this uid with one link is rewritten. Anything else found
        under the spare's name (a planted link, a FIFO, a hard link to someone's file)
        is removed from the directory, never written through: its target is untouched.
        """
        directory, _, spare = check_key(reuse).rpartition("/")
        if directory != key.rpartition("/")[0]:
            return None
        self.counters.add(requests=1)
        try:
            # the old name vanishes atomically, as a delete would
            os.rename(spare, tmp, src_dir_fd=handle.fd, dst_dir_fd=handle.fd)
        except OSError:
            return None  # gone already, or unmovable: a fresh file does the job
        try:
            # lstat first: a planted device is never even opened
            if stat.S_ISREG(os.stat(tmp, dir_fd=handle.fd, follow_symlinks=False).st_mode):
                fd = os.open(tmp, _REUSE_FLAGS, dir_fd=handle.fd)
                if _is_own_plain_file(os.fstat(fd)):
                    return fd
                os.close(fd)
        except OSError:
            pass
        _unlink_quietly(tmp, handle.fd)
        return None

    def _publish(self, handle: _Dir, tmp: str, name: str, key: str, exclusive: bool) -> None:
        """Give the written temp file its final name: atomically replacing what is there,
        or (``exclusive``) only if nothing is. A link at the name is replaced or
        refused, never followed."""
        try:
            if exclusive:
                # link() fails if the name exists: an atomic create-if-absent that
                # also holds on NFS (the classic lock-file idiom)
                os.link(tmp, name, src_dir_fd=handle.fd, dst_dir_fd=handle.fd,
                        follow_symlinks=False)
                os.unlink(tmp, dir_fd=handle.fd)
            else:
                os.replace(tmp, name, src_dir_fd=handle.fd, dst_dir_fd=handle.fd)
        except FileExistsError:
            # taken: by an object (the answer the caller wants), or by something else
            _require_regular(self._path(key), handle.fd, name)
            raise
        except OSError as exc:
            if exc.errno in _OCCUPIED_ERRNOS:
                raise _occupied(self._path(key), handle.fd, name) from None
            raise

    def _vanished(self, key: str) -> StorageError:
        path = self._path(key)
        where = ("the run directory" if not os.path.isdir(self.root)
                 else f"its directory {os.path.dirname(path)}")
        return StorageError(
            f"cannot publish: {where} does not exist (any more)", path=path,
            hint="was the run directory deleted? restart the job (in a fresh directory if "
            "it was removed on purpose)",
        )

    def open(self, key: str, *, max_bytes: int | None = None,
             rank: int | None = None) -> Reader | None:
        self.counters.add(requests=1)
        try:
            fd, size = self._retry("opening", key, self._open_regular, key)
        except FileNotFoundError:
            # "not yet", unless a cached directory was removed (and made again) meanwhile
            if not self._forget_gone(force=False):
                return None
            try:
                fd, size = self._retry("opening", key, self._open_regular, key)
            except FileNotFoundError:
                return None
        try:
            self._check_size(key, size, max_bytes, rank)  # by fstat: nothing read yet
        except BaseException:
            os.close(fd)
            raise
        return _FdReader(fd, f"{self.root}/{key}", self.counters, size)

    def _open_regular(self, key: str, flags: int = _READ_FLAGS) -> tuple[int, int]:
        """(fd, size) of ``key`` opened with ``flags``: never through a link, never
        waiting for a FIFO's writer, and only when it is a regular file."""
        handle, name = self._locate(key)
        try:
            fd = os.open(name, flags, FILE_MODE, dir_fd=handle.fd)
        except OSError as exc:
            if exc.errno in _OCCUPIED_ERRNOS:
                raise _occupied(self._path(key), handle.fd, name) from None
            raise
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise _occupied(self._path(key), handle.fd, name, mode=info.st_mode)
        return fd, info.st_size

    def park(self, key: str) -> str | None:
        if not self.can_recycle:
            return None
        spare = names.spare()
        self.counters.add(requests=1)
        try:
            handle, name = self._locate(key)
            self._retry("parking", key, os.rename, name, spare, src_dir_fd=handle.fd,
                        dst_dir_fd=handle.fd)
        except FileNotFoundError:
            return None
        return names.within(key.rpartition("/")[0], spare)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.counters.add(requests=1)
            try:
                handle, name = self._locate(key)
                self._retry("deleting", key, self._unlink, handle, name, key)
            except FileNotFoundError:
                pass

    def _unlink(self, handle: _Dir, name: str, key: str) -> None:
        """unlink() removes a link itself, never its target; a directory is refused."""
        try:
            os.unlink(name, dir_fd=handle.fd)
        except IsADirectoryError:
            raise _occupied(self._path(key), handle.fd, name) from None

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """Regular files only: a link, FIFO or socket is no object (see ``irregular``)."""
        return sorted((key, size) for key, mode, size in self._entries(prefix)
                      if stat.S_ISREG(mode))

    def irregular(self, prefix: str = "") -> list[tuple[str, str]]:
        """(key, what it is) of every entry below ``prefix`` that is neither a regular
        file nor a directory: links, FIFOs, sockets, devices. ferrosync never writes
        them; the operator tools report them and leave them alone."""
        return sorted((key, file_kind(mode)) for key, mode, _ in self._entries(prefix)
                      if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)))

    def _entries(self, prefix: str) -> list[tuple[str, int, int]]:
        """(key, mode, size) of everything below ``prefix``, from lstat: links are
        listed, never followed, and a directory is entered only through a handle
        opened without following links."""
        try:
            top = self._dir(check_key(prefix) if prefix else "")
            fd = os.open(".", _LIST_FLAGS, dir_fd=top.fd)  # readable, and scandir's own
        except FileNotFoundError:
            return []
        out: list[tuple[str, int, int]] = []
        _walk(fd, prefix, out)
        return out

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove directory ``prefix`` and the empty directories below it, children
        first. Nothing is followed: a link at ``prefix`` or below is left alone, and
        so is a directory something new appeared in."""
        directory, _, name = check_key(prefix).rpartition("/")
        try:
            parent = self._dir(directory)
            fd = os.open(name, _LIST_FLAGS, dir_fd=parent.fd)
        except (OSError, StorageError):
            return  # gone, or not a directory (a link): nothing of ours to remove
        _remove_empty_below(fd)
        try:
            os.rmdir(name, dir_fd=parent.fd)  # rmdir() of a link fails: never followed
        except OSError:
            pass
        self._forget_gone()

    def open_lock(self, key: str) -> int:
        """A read-write descriptor of ``key`` (created if missing) to hold an fcntl
        lock on; only a regular file, never through a link (a lock file opened with
        O_TRUNC through a planted link would empty the link's target)."""
        self.counters.add(requests=1)
        return self._retry("opening the lock file", key, self._open_regular, key,
                           _LOCK_FLAGS)[0]


def _is_own_plain_file(info: os.stat_result) -> bool:
    """A file safe to rewrite in place: regular, ours, and reachable by one name only
    (a second link could be someone's file planted as our spare)."""
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
            and info.st_nlink == 1)


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISREG, "a regular file"))


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words, for messages."""
    for test, what in _KINDS:
        if test(mode):
            return what
    return "something that is not a regular file"


def _occupied(path: str, dir_fd: int, name: str, *, mode: int | None = None,
              expected: str = "a regular file") -> StorageError:
    """The error for a name held by something ferrosync refuses to open or replace."""
    if mode is None:
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            mode = 0
    return StorageError(f"{file_kind(mode)} occupies this name where ferrosync expects "
                        f"{expected}; refused", path=path, hint=_OCCUPIED_HINT)


def _require_regular(path: str, dir_fd: int, name: str) -> None:
    """Raise ``_occupied`` unless ``name`` is a regular file (by lstat) or gone."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _occupied(path, dir_fd, name, mode=mode)


def _mkdir_at(name: str, dir_fd: int) -> None:
    try:
        os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass  # made by another rank, or something else: opening it will tell


def _walk(fd: int, base: str, out: list) -> None:
    """Append (key, mode, size) of everything in the directory ``fd`` (closed here)
    and below it to ``out``; lstat only, and directories opened with O_NOFOLLOW."""
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                key = f"{base}/{entry.name}" if base else entry.name
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the directory was read
                out.append((key, info.st_mode, info.st_size))
                if stat.S_ISDIR(info.st_mode):
                    try:
                        sub = os.open(entry.name, _LIST_FLAGS, dir_fd=fd)
                    except OSError:
                        continue  # removed, or replaced by a link since: not entered
                    _walk(sub, key, out)
    finally:
        os.close(fd)


def _remove_empty_below(fd: int) -> None:
    """rmdir every empty directory below the directory ``fd`` (closed here), children
    first; links are not followed and non-empty directories stay."""
    try:
        with os.scandir(fd) as entries:
            subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        for name in subdirs:
            try:
                sub = os.open(name, _LIST_FLAGS, dir_fd=fd)
            except OSError:
                continue
            _remove_empty_below(sub)
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                pass  # not empty: something new appeared there; leave it
    finally:
        os.close(fd)


def _write_file(path: str, parts: Sequence, *, dir_fd: int | None = None,
                fd: int | None = None) -> int:
    """Write ``parts`` to ``path`` (relative to ``dir_fd`` if given) and return the
    bytes written; on any failure the file is removed.

    Without ``fd`` the file is created here (O_EXCL|O_NOFOLLOW: never an existing
    name, never a link's target); with ``fd``, an already checked spare open as
    ``path``, the old bytes are overwritten and the file is cut to size.
    """
    existing = fd is not None
    if fd is None:
        fd = os.open(path, _CREATE_FLAGS, FILE_MODE, dir_fd=dir_fd)
    try:
        try:
            views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
            total = 0
            while views:
                # writev may write less than asked, and takes at most IOV_MAX buffers
                n = os.writev(fd, views[:512])
                total += n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            if existing:
                os.ftruncate(fd, total)
        finally:
            os.close(fd)  # on NFS close() flushes, and may be where ENOSPC shows
    except BaseException:
        _unlink_quietly(path, dir_fd)
        raise
    return total


def _unlink_quietly(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


class ExclusiveCreateUnsupported(StorageError):
    """This store (its fsspec driver, or the client under it) cannot create an object
    only if absent; ``put(exclusive=True)`` raises it instead of overwriting."""


#: what to do about a store without exclusive create (its ConfigError and StorageError)
EXCLUSIVE_CREATE_HINT = (
    "use a driver that creates only if absent (s3fs with botocore >= 1.35.20, gcsfs, "
    "adlfs: docs/operations.md#object-stores), and run `ferrosync doctor URL` to see "
    "what this store supports")


def _generic_create(fs) -> str | None:
    """Why ``fs`` cannot create exclusively, where its class alone says so: a
    synchronous driver that keeps fsspec's generic ``pipe_file``, whose
    ``mode="create"`` is ``exists()`` and then a plain write, so two writers can both
    pass the check and both "create". None where the driver has its own create (which
    connect's probe then tries on the location)."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    if isinstance(fs, AsyncFileSystem) or type(fs).pipe_file is not AbstractFileSystem.pipe_file:
        return None
    return (f"the {type(fs).__name__} driver keeps fsspec's generic pipe_file, whose create "
            "checks exists() and then overwrites: two writers can both create one name")


def gcs_driver(cls, storage_options: dict):
    """The gcsfs class for a ``gs://`` URL: gcsfs's HTTP (JSON API) driver,
    ``gcsfs.core.GCSFileSystem``, where the endpoint is not Google's
    (``endpoint_url`` in ``storage_options`` or ``$STORAGE_EMULATOR_HOST``: an emulator
    such as fake-gcs-server, or a GCS-compatible server); ``cls`` otherwise.

    gcsfs >= 2026 makes ``gcsfs.GCSFileSystem`` its ``ExtendedGcsFileSystem`` unless
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` when gcsfs is imported. That class asks
    the Storage Control API over gRPC for each bucket's layout (zonal, hierarchical)
    and does not cache a failed answer: against an HTTP-only endpoint every upload
    waited for gRPC's retries, a minute or more (92-96 s a 1 KiB put on a loaded
    2-core machine, against 0.01 s with the JSON API driver). Zonal buckets exist only on Google's
    endpoint, so elsewhere the JSON API driver is the whole of gcsfs that applies.
    """
    endpoint = storage_options.get("endpoint_url") or os.environ.get(
        "STORAGE_EMULATOR_HOST", "")
    if not endpoint or endpoint == "default":
        return cls
    host = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}").hostname or ""
    if host == "googleapis.com" or host.endswith(".googleapis.com"):
        return cls
    try:
        from gcsfs.core import GCSFileSystem
    except ImportError:
        return cls
    if cls is not GCSFileSystem and issubclass(cls, GCSFileSystem) and hasattr(
            cls, "_lookup_bucket_type"):
        return GCSFileSystem
    return cls


class FsspecStorage(Storage):
    """Any fsspec filesystem that is not local: s3://, gs://, memory://, ..."""

    poll_initial = 5e-3
    poll_max = 0.2
    heartbeat_interval = 2.0
    round_trips_dominate = True

    def __init__(self, url: str, fs, root: str) -> None:
        super().__init__(url)
        self.fs = fs
        self.root = root.rstrip("/")
        proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if proto == "memory":
            # in-process dictionary: polling it costs nothing
            self.poll_initial, self.poll_max, self.heartbeat_interval = 20e-6, 0.005, 1.0
            self.cheap_deletes = True
            self.round_trips_dominate = False
        #: s3fs: ``put(exclusive=True)`` is one conditional PUT (``If-None-Match: *``)
        self._s3 = proto in ("s3", "s3a") and hasattr(fs, "call_s3")
        #: why this driver cannot create exclusively, where its class says so already
        self._no_create = None if self._s3 else _generic_create(fs)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}" if key else self.root

    def put(self, key: str, parts: Sequence, *, exclusive: bool = False,
            reuse: str | None = None) -> int:
        if reuse is not None:
            self.delete([reuse])  # an object store has nothing to recycle
        views = [memoryview(p).cast("B") for p in parts]
        data = views[0].tobytes() if len(views) == 1 else b"".join(views)
        path = self._path(key)
        if exclusive and self._s3:
            self._retry("creating", key, self._s3_create, key, path, data)
        elif exclusive and self._no_create:
            raise ExclusiveCreateUnsupported(self._no_create, path=self.path_of(key),
                                             hint=EXCLUSIVE_CREATE_HINT)
        else:
            mode = "create" if exclusive else "overwrite"
            try:
                self._retry("writing", key, self._pipe, key, path, data, mode)
            except FileNotFoundError:
                # a driver with real directories and no auto-mkdir (sftp, a local
                # filesystem class): its parent is made on demand, then once more
                self._make_parent(key, path)
                try:
                    self._retry("writing", key, self._pipe, key, path, data, mode)
                except FileNotFoundError as exc:
                    raise StorageError(
                        f"cannot write: its directory does not exist ({exc})",
                        path=self.path_of(key), hint="check that the URL is a writable "
                        "location, and that nothing removes directories under it") from None
        self.counters.add(puts=1, written=len(data))
        return len(data)

    def _make_parent(self, key: str, path: str) -> None:
        parent = path.rpartition("/")[0]
        if parent:
            self.counters.add(requests=1)
            try:
                self._retry("creating the directory", key, self.fs.makedirs, parent,
                            exist_ok=True)
            except FileExistsError:
                pass  # made meanwhile by another rank (a driver that ignores exist_ok)

    def _pipe(self, key: str, path: str, data: bytes, mode: str) -> None:
        try:
            self.fs.pipe_file(path, data, mode=mode)
        except TypeError:
            # a driver without the ``mode`` keyword: a plain overwrite is all it does, so
            # a create must never degrade to one (connect's probe refuses the store)
            if mode == "create":
                raise ExclusiveCreateUnsupported(
                    f"the {type(self.fs).__name__} driver's pipe_file takes no mode, so it "
                    "cannot create an object only if absent", path=self.path_of(key),
                    hint=EXCLUSIVE_CREATE_HINT) from None
            self.fs.pipe_file(path, data)
        except Exception as exc:  # any driver's error: only a 412 is translated, all re-raise
            if mode == "create" and self._precondition_failed(exc):
                raise FileExistsError(errno.EEXIST, "the object exists already",
                                      self.path_of(key)) from exc
            raise

    def _s3_create(self, key: str, path: str, data: bytes) -> None:
        """Create ``path`` only if absent: one PUT with ``If-None-Match: *``.

        The server answers 412 Precondition Failed when the key exists (AWS S3 since
        2024-08, MinIO, SeaweedFS, moto); that is ``FileExistsError``. AWS answers 409
        ConditionalRequestConflict while a concurrent conditional write of the key is
        in flight: retried here, a few times. A 412 after botocore retried our own PUT
        (its first attempt may have landed, the answer lost) is checked by reading the
        object back: our bytes there mean the create was ours.

        Called through s3fs's ``call_s3`` rather than ``pipe_file(mode="create")``:
        the same request on every s3fs version, and s3fs's own translation maps a 412
        without AWS's ``Condition`` field (SeaweedFS, MinIO) to EINVAL, not EEXIST.
        """
        if not self._botocore_has_if_none_match():
            raise ExclusiveCreateUnsupported(
                "exclusive create needs conditional writes (If-None-Match), which this "
                "botocore cannot send", path=self.path_of(key),
                hint="upgrade botocore to 1.35.20 or newer (pip install -U s3fs botocore)")
        bucket, name, _ = self.fs.split_path(path)
        delay = 0.05
        for attempt in range(self._CONFLICT_RETRIES + 1):
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data,
                                IfNoneMatch="*")
                return
            except Exception as exc:  # s3fs translates ClientError: look at the cause; re-raised
                response = _s3_response(exc)
                if self._precondition_failed(exc):
                    retried = (response or {}).get("ResponseMetadata", {}).get(
                        "RetryAttempts", 0)
                    if (retried or getattr(self.fs, "retries", 1) > 1) and (
                            self._holds(path, data)):
                        return  # our earlier attempt created it
                    raise FileExistsError(errno.EEXIST, "the object exists already",
                                          self.path_of(key)) from None
                code = (response or {}).get("Error", {}).get("Code")
                if code != "ConditionalRequestConflict" or attempt == self._CONFLICT_RETRIES:
                    raise
                time.sleep(delay)
                delay *= 2
            finally:
                self.fs.invalidate_cache(path)

    # -- conditional writes (s3fs) -------------------------------------------------------
    #: retries of a conditional PUT that AWS answered 409 ConditionalRequestConflict
    _CONFLICT_RETRIES = 4
    _if_none_match: bool | None = None  # whether botocore can send it (checked once)

    @staticmethod
    def _precondition_failed(exc: BaseException) -> bool:
        """Whether ``exc`` is an HTTP 412 (PreconditionFailed) from a conditional write
        (or the driver's own ``FileExistsError`` for it)."""
        if _s3_response(exc) is not None:
            return _http_status(exc) == 412 or _s3_code(exc) == "PreconditionFailed"
        return isinstance(exc, FileExistsError) or _http_status(exc) == 412

    @classmethod
    def _botocore_has_if_none_match(cls) -> bool:
        """Whether the installed botocore knows PutObject's IfNoneMatch (1.35.20+): s3fs
        silently drops parameters its botocore does not know, which would turn an
        exclusive create into an overwrite."""
        if cls._if_none_match is None:
            FsspecStorage._if_none_match = _botocore_knows("PutObject", "IfNoneMatch")
        return bool(cls._if_none_match)

    def _holds(self, path: str, data: bytes) -> bool:
        """Whether the object at ``path`` holds exactly ``data``."""
        self.counters.add(gets=1)
        try:
            return self._cat(path, len(data) + 1) == data
        except FileNotFoundError:
            return False

    def open(self, key: str, *, max_bytes: int | None = None,
             rank: int | None = None) -> Reader | None:
        self.counters.add(gets=1)
        # bounded: ask for one byte more than the largest legal object, so an oversized
        # one costs max_bytes + 1 bytes of memory and transfer, never its claimed size
        end = None if max_bytes is None else max_bytes + 1
        try:
            # start=0 (by keyword: s3fs's second positional is version_id) makes s3fs
            # send one ranged GET instead of HEAD + GET, and a miss costs one request
            # instead of HEAD + LIST
            data = self._retry("reading", key, self._cat, self._path(key), end)
        except FileNotFoundError:
            return None
        self.counters.add(read=len(data))
        if max_bytes is not None and len(data) > max_bytes:
            raise oversized(self.path_of(key), None, max_bytes, rank)
        return _BytesReader(data)

    def _cat(self, path: str, end: int | None = None) -> bytes:
        if end is None:
            return self.fs.cat_file(path, start=0)
        return self.fs.cat_file(path, start=0, end=end)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        paths = [self._path(k) for k in keys]
        self.counters.add(deletes=1 + len(paths) // 1000)  # one DeleteObjects per 1000
        # errors name the key (``_retry`` makes the full URL of it), never the fs path
        what = "deleting" if len(keys) == 1 else f"deleting {len(keys)} objects"
        try:
            self._retry(what, keys[0], self.fs.rm, paths)
        except FileNotFoundError:
            for key, path in zip(keys, paths):  # some backends stop at the first missing one
                try:
                    self._retry("deleting", key, self.fs.rm_file, path)
                except FileNotFoundError:
                    pass

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        base = self._path(prefix)
        self.fs.invalidate_cache()
        self.counters.add(lists=1)  # at least one: a LIST page holds up to 1000 keys
        try:
            found = self._retry("listing", prefix, self.fs.find, base, detail=True)
        except FileNotFoundError:
            return []
        strip = len(self.root) + 1
        # objects only: stores with real directories (SeaweedFS keeps an emptied
        # "folder" for a while) and directory markers make s3fs report directories,
        # the searched prefix itself among them
        return sorted((p[strip:], int(info.get("size") or 0)) for p, info in found.items()
                      if info.get("type") != "directory" and len(p) > strip)

    #: seconds the first contact (``probe_bucket``) may take; None: the driver's own
    #: timeouts (``open_storage(timeout=)`` sets it)
    first_contact_timeout: float | None = None
    #: where the store is, in words, for messages (S3: the endpoint and where it came
    #: from); None: the URL says it
    endpoint: str | None = None

    def probe_bucket(self) -> None:
        """Fail early, with a ``ConfigError`` saying what to check, when the bucket (or
        container) is missing or unreadable, the endpoint cannot be reached (within
        ``first_contact_timeout``), the credentials are missing or refused, or the URL
        names an existing object rather than a prefix."""
        from fsspec.implementations.memory import MemoryFileSystem

        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if proto in ("memory",) or isinstance(self.fs, MemoryFileSystem):
            return  # a dictionary in this process (or a driver built on one): no bucket
        bucket = self.root.split("/", 1)[0]
        try:
            self._first_contact(self.fs, "_ls", "ls", bucket, refresh=True)
        except FileNotFoundError as exc:
            raise ConfigError(
                f"bucket {bucket!r} does not exist",
                path=self.url,
                hint="create it first (e.g. `aws s3 mb s3://BUCKET`) or fix the URL",
            ) from exc
        except PermissionError as exc:
            raise ConfigError(
                f"no access to bucket {bucket!r} ({exc})",
                path=self.url,
                hint="check the credentials and the bucket policy",
            ) from exc
        except Exception as exc:  # any driver's error: translated, or wrapped with the path
            raise self._contact_error(proto, exc) from None
        if self.root != bucket:
            try:
                is_object = self._first_contact(self.fs, "_isfile", "isfile", self.root)
            except Exception:  # noqa: BLE001 - unknown: the first real request will say
                is_object = False
            if is_object:
                raise ConfigError(
                    "the URL names an existing object, not a prefix to keep a job's "
                    "objects under", path=self.url,
                    hint="pass the prefix (\"directory\") the job should use, e.g. "
                    f"{self.url.rstrip('/')}-run/ or the URL without its last part")

    def _first_contact(self, fs, async_name: str, name: str, *args, **kwargs):
        """``fs.<name>(*args)``, bounded by ``first_contact_timeout`` where the driver is
        asynchronous (the request is cancelled then)."""
        if not _accepts_refresh(fs) or name != "ls":
            kwargs.pop("refresh", None)
        timeout = self.first_contact_timeout
        if timeout and getattr(fs, "async_impl", False) and hasattr(fs, async_name):
            from fsspec.asyn import sync

            return sync(fs.loop, getattr(fs, async_name), *args, timeout=timeout, **kwargs)
        return getattr(fs, name)(*args, **kwargs)

    def _contact_error(self, proto: str, exc: BaseException) -> FerrosyncError:
        """The error for a failed first contact: what is wrong, and what to check."""
        where = self.endpoint or f"the {proto}:// store"
        cause = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        names = {type(c).__name__ for c in _causes(exc)}
        code = _s3_code(exc)
        if names & _NO_CREDENTIALS or code in _BAD_CREDENTIALS:
            return ConfigError(
                f"no usable credentials for {where} ({cause})", path=self.url,
                hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                "AWS_SESSION_TOKEN for temporary ones), or AWS_PROFILE, or pass "
                "storage_options key/secret (anon=True for a public bucket)"
                if proto in ("s3", "s3a") else "check the credentials the driver uses")
        if names & _TIMED_OUT or isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            return ConfigError(
                f"no answer from {where} within "
                f"{self.first_contact_timeout or 'the driver timeout'} s ({cause})",
                path=self.url, hint=_ENDPOINT_HINT if proto in ("s3", "s3a") else
                "check that the store is reachable from this host")
        if _is_transient(exc) or names & _UNREACHABLE:
            return ConfigError(
                f"cannot reach {where} ({cause})", path=self.url,
                hint=_ENDPOINT_HINT if proto in ("s3", "s3a") else
                "check that the store is reachable from this host")
        return _storage_error("contacting the store", self.url, exc, False)


# first-contact failures, by the class names of the errors behind them (botocore's and
# aiohttp's, which need not be installed)
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "NoAuthTokenError"}
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                    "InvalidToken", "TokenRefreshRequired"}
_TIMED_OUT = {"ConnectTimeoutError", "ReadTimeoutError", "FSTimeoutError"}
_UNREACHABLE = {"EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError",
                "ClientOSError", "gaierror"}
_ENDPOINT_HINT = ("check the endpoint: storage_options endpoint_url, or $AWS_ENDPOINT_URL / "
                  "$AWS_ENDPOINT_URL_S3 (for a local server such as MinIO or SeaweedFS), "
                  "and that the server is running and reachable from this host")


def _botocore_knows(operation: str, parameter: str) -> bool:
    """Whether the installed botocore's S3 model has ``parameter`` in ``operation``."""
    try:
        import botocore.exceptions
        import botocore.model
        import botocore.session
    except ImportError:
        return False
    try:
        model = botocore.session.get_session().get_service_model("s3")
        members = model.operation_model(operation).input_shape.members
    except (botocore.exceptions.BotoCoreError, botocore.model.OperationNotFoundError):
        # no S3 model in this botocore (DataNotFoundError), or no such operation:
        # treat as unsupported
        return False
    return parameter in members


def _accepts_refresh(fs) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.ls).parameters
    except (TypeError, ValueError):
        return False


# Filesystems whose page cache is the only cache: rewriting a file in place is seen by
# every reader at once, and ranks on other nodes cannot share them. Network and FUSE
# filesystems are excluded on purpose.
LOCAL_FILESYSTEMS = frozenset({
    "tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "overlay",
    "jfs", "reiserfs", "bcachefs"})


def mount_of(path: str) -> dict | None:
    """The mount holding ``path`` (the longest mount point that contains it, the later
    of two at one point): ``{"source", "mountpoint", "fstype", "options"}``, or None
    where /proc/self/mountinfo cannot be read (not Linux).

    A path that does not exist yet is looked up by its nearest existing parent.
    ``options`` are the mount's own and its superblock's (where NFS keeps ``nocto``,
    ``lookupcache``, ``soft``), as /proc/self/mounts would show them.
    """
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best = None
    for line in lines:
        mount = _mountinfo_entry(line)
        if mount is None:
            continue
        point = mount["mountpoint"]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best["mountpoint"])):
            best = mount
    return best


def _mountinfo_entry(line: str) -> dict | None:
    """One line of /proc/self/mountinfo (proc(5)): ``id parent dev root mountpoint
    options [optional fields...] - fstype source super-options``."""
    left, _, right = line.partition(" - ")
    fields, tail = left.split(), right.split()
    if len(fields) < 6 or len(tail) < 2:
        return None
    options = fields[5].split(",")
    if len(tail) > 2:
        options += [o for o in tail[2].split(",") if o not in options]
    return {"source": _unescape(tail[1]), "mountpoint": _unescape(fields[4]),
            "fstype": tail[0], "options": [_unescape(o) for o in options]}


def _unescape(text: str) -> str:
    """The kernel writes space, tab, newline and backslash in mount fields as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def is_local_filesystem(path: str) -> bool:
    """True when ``path`` lies on a local filesystem (``LOCAL_FILESYSTEMS``)."""
    mount = mount_of(path)
    return mount is not None and mount["fstype"] in LOCAL_FILESYSTEMS


def split_url(url: str) -> tuple[str, str]:
    """(protocol, rest). A bare path, or ``file://``, is protocol "file".

    For ``file://`` the rest is the path (RFC 8089): ``file:///p`` and
    ``file://localhost/p`` are both ``/p``; any other host is a ``ConfigError`` (ranks
    started in different directories must never read a host name as a relative path).
    """
    if "://" not in url:
        return "file", url
    parts = urlsplit(url)
    protocol, rest = parts.scheme.lower(), url.split("://", 1)[1]
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
                 timeout: float | None = None) -> Storage:
    """Storage for ``url``. Validates the URL; does no I/O on object stores yet.

    ``timeout`` (seconds; ``connect``'s) bounds the first contact with an object
    store (``probe_bucket``) and, on S3, botocore's own connect/read timeouts and
    retries, so a dead or mistyped endpoint fails within it. A missing fsspec driver
    is a ``ConfigError`` with the ``pip install`` that adds it.
    """
    protocol, rest = split_url(url)
    storage_options = dict(storage_options or {})
    if protocol in ("file", "local"):
        if storage_options:
            raise ConfigError(
                f"storage_options {sorted(storage_options)} do not apply to a local path",
                hint="drop storage_options for a directory URL",
            )
        if not rest:
            raise ConfigError(f"URL {url!r} names no directory")
        return LocalStorage(rest)
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry
    except ImportError as exc:  # pragma: no cover - fsspec is a hard dependency
        raise ConfigError("fsspec is not installed", hint="pip install fsspec") from exc
    # fsspec.registry.registry: drivers a user registered (register_implementation)
    if protocol not in known_implementations and protocol not in registry:
        raise ConfigError(
            f"unknown URL scheme {protocol!r} in {url!r}",
            hint="use a directory path, file://, an fsspec URL (s3://, gs://, memory://) "
            "or gloo://, nccl://, torch://",
        )
    # the driver first: everything below may import it (botocore for s3://)
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"the {protocol}:// driver is not installed ({exc})", path=url,
            hint=_driver_hint(protocol, exc),
        ) from None
    if protocol in ("gs", "gcs"):
        cls = gcs_driver(cls, storage_options)
    retries = None
    endpoint = None
    if protocol in ("s3", "s3a"):
        endpoint = _s3_endpoint(storage_options)
        try:
            _s3_settings(storage_options, timeout)
        except ImportError as exc:  # s3fs without botocore/aiobotocore
            raise ConfigError(
                f"the {protocol}:// driver is incomplete ({type(exc).__name__}: {exc})",
                path=url, hint="pip install 'ferrosync[s3]'") from None
        retries = 0
    try:
        # skip_instance_cache: our own instance, so our settings and caches are ours
        fs = cls(skip_instance_cache=True, **storage_options)
    except TypeError as exc:
        raise ConfigError(
            f"storage_options rejected by {cls.__name__}: {exc}", path=url,
            hint="check the option names against the fsspec driver's documentation",
        ) from None
    root = fs._strip_protocol(url)
    if isinstance(root, list):  # pragma: no cover - defensive
        root = root[0]
    if root.startswith(f"{protocol}://"):
        # a registered driver that inherits another's _strip_protocol (a subclass of
        # MemoryFileSystem strips only "memory://"): its own scheme is no part of a path
        root = fs._strip_protocol(root[len(protocol) + 3:])
    storage = FsspecStorage(url, fs, root)
    storage.first_contact_timeout = timeout
    storage.endpoint = endpoint
    if retries is not None:
        storage.retries = retries
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own loop: a single attempt, botocore retries

    return storage


def _driver_hint(protocol: str, exc: BaseException) -> str:
    """The ``pip install`` that adds ``protocol``'s fsspec driver, from fsspec's own
    ``known_implementations``: the driver's package, or (for drivers inside fsspec)
    the module its import missed."""
    from fsspec.registry import known_implementations

    if protocol in ("s3", "s3a"):
        return "pip install 'ferrosync[s3]'"
    module = str(known_implementations.get(protocol, {}).get("class", "")).split(".")[0]
    if module and module != "fsspec":
        return f"pip install {module.replace('_', '-')}"
    for cause in _causes(exc):
        name = getattr(cause, "name", None)
        if isinstance(cause, ImportError) and name:
            return f"pip install {name.split('.')[0].replace('_', '-')}"
    err = known_implementations.get(protocol, {}).get("err")
    return f"install the fsspec driver for {protocol}://" + (f" ({err})" if err else "")


def _s3_settings(storage_options: dict, timeout: float | None) -> None:
    """botocore settings for s3fs, in ``storage_options`` (the user's own win).

    One retry layer, not three multiplied (botocore x s3fs x ours took 2 minutes to
    report a dead endpoint): botocore's adaptive mode backs off on 503 SlowDown and
    connection errors; s3fs and ferrosync then try once. With ``timeout`` its connect
    and read timeouts and its attempts fit in it: a closed port or an unreachable
    endpoint is reported within ``connect``'s timeout, not after botocore's defaults.
    """
    connect_s, read_s, attempts = 5.0, 60.0, 5
    if timeout is not None and timeout > 0:
        connect_s = min(connect_s, max(0.5, timeout / 4))
        read_s = min(read_s, max(1.0, timeout))
        attempts = 5 if timeout >= 60 else 3 if timeout >= 15 else 2
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"mode": "adaptive", "max_attempts": attempts})
    config.setdefault("connect_timeout", connect_s)
    config.setdefault("read_timeout", read_s)
    for key, value in _redundant_checksums_off().items():
        config.setdefault(key, value)
    if _s3_endpoint_uses_tls(storage_options):
        s3_config = dict(config.get("s3") or {})
        s3_config.setdefault("payload_signing_enabled", False)
        config["s3"] = s3_config
    storage_options["config_kwargs"] = config
    if "session" not in storage_options:
        storage_options["session"] = _s3_session_without_expect_continue()


def _s3_endpoint(storage_options: dict) -> str:
    """The S3 endpoint ``storage_options`` (or the environment) point s3fs at, in
    words, for error messages."""
    client = storage_options.get("client_kwargs") or {}
    for name, value in (("endpoint_url", storage_options.get("endpoint_url")),
                        ("client_kwargs endpoint_url", client.get("endpoint_url")),
                        ("$AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
                        ("$AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL"))):
        if value:
            return f"{value} (from {name})"
    return "AWS S3 itself (no endpoint_url, $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL set)"


def _redundant_checksums_off() -> dict:
    """botocore settings that skip its own CRC of every request and response body
    where S3 does not require one.

    Every object ferrosync writes carries its own checksum (xxh3) or MAC over the
    whole payload, verified by every reader before a byte is used (``wire``), so
    botocore's CRC (default since botocore 1.36) only costs CPU on the ranks' cores:
    a 16 MiB PUT took 25-27 ms of client CPU with it, 18 ms without, and a 16 MiB GET
    31-32 ms against 16-17 ms (SeaweedFS on loopback). Operations S3 requires a
    checksum for still get one. Empty on a botocore without these settings."""
    from botocore.config import Config

    keys = ("request_checksum_calculation", "response_checksum_validation")
    return {k: "when_required" for k in keys if k in Config.OPTION_DEFAULTS}


def _s3_endpoint_uses_tls(storage_options: dict) -> bool:
    """Whether the S3 endpoint ``storage_options`` reach speaks HTTPS, so botocore's
    SHA-256 of every request body can be skipped (``payload_signing_enabled``).

    botocore signs each PUT's body unless the request goes over HTTPS *and* carries a
    checksum header; with its CRC off (``_redundant_checksums_off``) it hashes every
    body again, 8 ms of client CPU per 16 MiB (SeaweedFS on loopback, signed 16.7 ms
    against unsigned 8.9-9.2 ms a PUT). Over TLS the body cannot be changed in transit,
    and every reader checks ferrosync's own checksum or MAC, so the hash buys nothing.
    Over plain HTTP the signature is what guards the body in transit: it stays.

    HTTPS: an explicit endpoint (s3fs's ``endpoint_url``, ``client_kwargs``'s, or
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) that starts with ``https://``, or
    none at all (AWS itself, over TLS unless ``use_ssl`` is off).
    """
    client = storage_options.get("client_kwargs") or {}
    endpoint = (storage_options.get("endpoint_url") or client.get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        return str(endpoint).strip().lower().startswith("https://")
    return client.get("use_ssl", storage_options.get("use_ssl", True)) is not False


def _s3_session_without_expect_continue():
    """An aiobotocore session whose S3 clients never send ``Expect: 100-continue``.

    botocore adds the header to every PUT with a file-like body, and the client then
    waits for the server's ``100 Continue`` before sending the body: one more round
    trip per PUT. Through a 50 ms-RTT link a small PUT took 105 ms with it, 54 ms
    without (tools/wan_proxy.py, docs/goodput.md). What it would save, a rejected
    upload's bytes, does not apply to objects this small or this often written. A
    session given in ``storage_options`` is used as it is.
    """
    from aiobotocore.session import get_session
    from botocore.handlers import add_expect_header

    session = get_session()
    session.unregister("before-call.s3", add_expect_header)
    return session


class Backoff:
    """Sleep schedule for polling one exact name: doubling from ``initial`` to ``cap``.

    Starting well under a millisecond keeps small collectives fast on local disks;
    the cap bounds the request rate on billed object stores.
    """

    __slots__ = ("_delay", "_cap")

    def __init__(self, initial: float, cap: float) -> None:
        self._delay = initial
        self._cap = cap

    def sleep(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        time.sleep(max(0.0, min(self._delay, remaining)))
        self._delay = min(self._delay * 2, self._cap)


def probe_location(storage: Storage, rank: int | None = None, *,
                   what: str = "this location", exclusive: bool = True) -> None:
    """Fail now, with a ``ConfigError`` naming ``rank`` and the URL, unless ``storage``
    can be written and read back: a run must never start (and half-write anything)
    against a location it cannot use.

    Checks the bucket (``probe_bucket``, object stores; its ``ConfigError`` passes
    through), makes the root, then puts, reads and deletes one small probe object
    (``names.probe``). Between the read and the delete it tries to create that object
    again with ``put(exclusive=True)``, which must fail with ``FileExistsError``: every
    rendezvous and every elastic roster rests on a create that only one writer wins.
    A store that overwrites instead, or whose driver cannot create only if absent,
    is refused with a ``ConfigError`` (one request more, never a wait). A location
    nothing is ever created exclusively in (checkpoints) passes ``exclusive=False``.
    ``what`` names the location in the message ("this location", "sync URL", ...).
    Whoever probes before ranks exist (a launcher) passes ``rank=None``: the probe is
    then named as rank 0's, which the tools recognise all the same.
    """
    try:
        storage.probe_bucket()
    except ConfigError as exc:
        if exc.rank is not None or rank is None:
            raise
        raise ConfigError(exc.what, rank=rank, path=exc.path, hint=exc.hint) from exc.__cause__
    key = names.probe(0 if rank is None else rank)
    payload = b"ferrosync probe " + secrets.token_bytes(8)
    creates = True
    try:
        storage.makedirs("")
        storage.put(key, [payload])
        back = storage.read(key)
        try:
            if exclusive:
                storage.put(key, [b"ferrosync probe: a second create"], exclusive=True)
                creates = "a second create of one name succeeded: the store overwrote it"
        except FileExistsError:
            pass  # the answer every store must give
        except ExclusiveCreateUnsupported as exc:
            creates = exc.what
        storage.delete([key])
    except (StorageError, OSError) as exc:
        detail = exc.what if isinstance(exc, StorageError) else f"{type(exc).__name__}: {exc}"
        hint = exc.hint if isinstance(exc, StorageError) else None
        raise ConfigError(
            f"cannot use {what} ({detail})", rank=rank, path=storage.url,
            hint=hint or "check that the path is a writable directory (or the bucket "
            "exists) on every node",
        ) from None
    if back != payload:
        raise ConfigError(
            "read-after-write returned different bytes", rank=rank, path=storage.url,
            hint="this storage is not consistent enough for ferrosync (see `ferrosync "
            "doctor`)",
        )
    if creates is not True:
        raise ConfigError(
            f"{what} cannot create an object exclusively ({creates}): without it two "
            "jobs started on one URL can mix their data, and an elastic job cannot agree "
            "on its members", rank=rank, path=storage.url, hint=EXCLUSIVE_CREATE_HINT)


def object_exists(storage: Storage, key: str) -> bool:
    """Exact-name existence by opening it: errors other than "not found" propagate."""
    reader = storage.open(key)
    if reader is None:
        return False
    reader.close()
    return True
