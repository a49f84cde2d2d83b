"""One small interface over a shared directory or an fsspec object store.

A backend needs five things from storage, and this module gives exactly those:

* ``put(key, parts)``: publish an object atomically (readers see all of it or none);
* ``open(key)``: a reader for the object, or ``None`` when it does not exist *yet*;
* ``delete(keys)``: remove objects (missing ones are fine);
* ``makedirs(prefix)``: make a "directory" where the store has them;
* ``list(prefix)``: for operator tools only, never on the collective path.

Rules kept here (DESIGN.md §4):

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
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time
from typing import Iterable, Sequence
from urllib.parse import urlsplit

from .errors import ConfigError, StorageError

__all__ = [
    "Storage", "LocalStorage", "FsspecStorage", "open_storage", "Counters", "Backoff",
    "object_exists",
]

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


def check_key(key: str) -> str:
    """Keys are relative POSIX paths below the root: no escapes, no surprises."""
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or "\0" in key or any(
        p in ("", ".", "..") for p in parts
    ):
        raise ConfigError(f"invalid storage key {key!r}",
                          hint="keys are relative paths without '..', '.' or empty parts")
    return key


class Counters:
    """Thread-safe request and byte counters (the heartbeat thread also counts)."""

    __slots__ = ("_lock", "requests", "bytes_written", "bytes_read", "objects_written")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.objects_written = 0

    def add(self, requests: int = 0, written: int = 0, read: int = 0, objects: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_written += written
            self.bytes_read += read
            self.objects_written += objects

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": self.requests,
                "bytes_written": self.bytes_written,
                "bytes_read": self.bytes_read,
                "objects_written": self.objects_written,
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
    def __init__(self, fd: int, path: str, counters: Counters) -> None:
        self._fd = fd
        self._path = path
        self._counters = counters
        self.size = os.fstat(fd).st_size

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
    #: whether ``put(..., reuse=old_key)`` can recycle an old object's storage
    can_recycle: bool = False
    #: deleting costs microseconds (local files, memory), not a billed round trip
    cheap_deletes: bool = False

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

    def open(self, key: str) -> Reader | None:
        """A reader for ``key``, or None if it does not exist (the only "not yet")."""
        raise NotImplementedError

    def read(self, key: str) -> bytes | None:
        """The whole (small) object, or None if it does not exist."""
        reader = self.open(key)
        if reader is None:
            return None
        with reader:
            buf = bytearray(reader.size)
            n = reader.readinto(buf)
            return bytes(buf[:n])

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
    def _retry(self, what: str, key: str, fn, *args):
        """Run ``fn``; retry transient failures with bounded exponential back-off.

        "Not found" (FileNotFoundError) and FileExistsError are answers, not failures,
        and pass straight through; so do permanent errors, wrapped with the path
        and a hint so the caller can say what to do.
        """
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return fn(*args)
            except (FileNotFoundError, FileExistsError):
                raise
            except Exception as exc:  # botocore/aiohttp errors are not all OSErrors
                transient = _is_transient(exc)
                if not transient or attempt == self.retries:
                    raise _storage_error(what, self.path_of(key), exc, transient) from exc
                time.sleep(delay)
                delay = min(delay * 4, 2.0)
        raise AssertionError("unreachable")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    name = type(exc).__name__
    text = str(exc)
    return any(
        marker in name or marker in text
        for marker in (
            "SlowDown",
            "ServiceUnavailable",
            "InternalError",
            "RequestTimeout",
            "EndpointConnectionError",
            "ConnectionClosed",
            "ClientOSError",
            "ServerDisconnected",
            "ReadTimeout",
            "503",
            "500 ",
        )
    )


def _storage_error(what: str, path: str, exc: BaseException, transient: bool) -> StorageError:
    hint = None
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_HINTS:
        hint = _PERMANENT_HINTS[exc.errno]
    elif isinstance(exc, PermissionError) or "AccessDenied" in str(exc):
        hint = "access denied: check the credentials and the bucket policy"
    elif transient:
        hint = "the storage kept failing after retries: check that it is reachable"
    cause = f"{type(exc).__name__}: {exc}"
    return StorageError(f"{what} failed ({cause})", path=path, hint=hint)


class LocalStorage(Storage):
    """A directory on a local or network (NFS) filesystem."""

    poll_initial = 20e-6
    poll_max = 0.01
    heartbeat_interval = 1.0
    cheap_deletes = True

    def __init__(self, root: str, *, recycle: bool | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root)
        self.root = root
        self._made: set[str] = set()
        # Rewriting a consumed file in place skips the kernel zeroing fresh page-cache
        # pages (32 MiB: 5 ms instead of 15 ms on tmpfs). Only on local filesystems: an
        # NFS client may hold cached pages of the old contents under the same inode.
        self.can_recycle = is_local_filesystem(root) if recycle is None else bool(recycle)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key)) if key else self.root

    def makedirs(self, prefix: str) -> None:
        path = self._path(prefix)
        if path in self._made:
            return
        self._retry("creating the directory", prefix, os.makedirs, path, DIR_MODE, True)
        self._made.add(path)

    def put(self, key: str, parts: Sequence, *, exclusive: bool = False,
            reuse: str | None = None) -> int:
        final = self._path(key)
        directory, name = os.path.split(final)
        # The temporary name lives in the *same directory* so the rename is atomic;
        # the leading dot and ".tmp" mark it for `gc` if this process dies here.
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        recycled = False
        if reuse is not None and self.can_recycle:
            old = self._path(reuse)
            if os.path.dirname(old) == directory:
                try:
                    os.rename(old, tmp)  # the old name vanishes atomically, as a delete would
                    recycled = True
                except FileNotFoundError:
                    pass
            self.counters.add(requests=1)
        nbytes = self._retry("writing", key, _write_file, tmp, parts, recycled)
        try:
            if exclusive:
                # link() fails if the name exists: an atomic create-if-absent that
                # also holds on NFS (the classic lock-file idiom).
                self._retry("publishing", key, os.link, tmp, final)
                os.unlink(tmp)
            else:
                self._retry("publishing", key, os.replace, tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self.counters.add(requests=1, written=nbytes)
        return nbytes

    def open(self, key: str) -> Reader | None:
        path = self._path(key)
        self.counters.add(requests=1)
        try:
            fd = self._retry("opening", key, os.open, path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorageError("not a regular file", path=path,
                               hint="something else occupies this name: give the run its own URL")
        return _FdReader(fd, path, self.counters)

    def park(self, key: str) -> str | None:
        if not self.can_recycle:
            return None
        directory = os.path.dirname(key)
        spare = f"{directory}/.spare.{os.getpid()}.{secrets.token_hex(4)}".lstrip("/")
        self.counters.add(requests=1)
        try:
            os.rename(self._path(key), self._path(spare))
        except FileNotFoundError:
            return None
        return spare

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.counters.add(requests=1)
            try:
                self._retry("deleting", key, os.unlink, self._path(key))
            except FileNotFoundError:
                pass

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        base = self._path(prefix)
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    size = os.stat(full).st_size
                except FileNotFoundError:
                    continue
                out.append((os.path.relpath(full, self.root).replace(os.sep, "/"), size))
        return sorted(out)


def _write_file(path: str, parts: Sequence, existing: bool = False) -> int:
    """Write ``parts`` to a new file (or over an ``existing`` one, then cut it to
    size); on any failure the file is removed."""
    flags = os.O_WRONLY if existing else os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(path, flags, FILE_MODE)
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
        _unlink_quietly(path)
        raise
    return total


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class FsspecStorage(Storage):
    """Any fsspec filesystem that is not local: s3://, gs://, memory://, ..."""

    poll_initial = 5e-3
    poll_max = 0.2
    heartbeat_interval = 2.0

    def __init__(self, url: str, fs, root: str) -> None:
        super().__init__(url)
        self.fs = fs
        self.root = root.rstrip("/")
        proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if proto == "memory":
            # in-process dictionary: polling it costs nothing
            self.poll_initial, self.poll_max, self.heartbeat_interval = 20e-6, 0.005, 1.0
            self.cheap_deletes = True

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}" if key else self.root

    def put(self, key: str, parts: Sequence, *, exclusive: bool = False,
            reuse: str | None = None) -> int:
        if reuse is not None:
            self.delete([reuse])  # an object store has nothing to recycle
        views = [memoryview(p).cast("B") for p in parts]
        data = views[0].tobytes() if len(views) == 1 else b"".join(views)
        mode = "create" if exclusive else "overwrite"
        self._retry("writing", key, self._pipe, self._path(key), data, mode)
        self.counters.add(requests=1, written=len(data))
        return len(data)

    def _pipe(self, path: str, data: bytes, mode: str) -> None:
        try:
            self.fs.pipe_file(path, data, mode=mode)
        except TypeError:
            # an implementation without the ``mode`` keyword: plain overwrite
            self.fs.pipe_file(path, data)
        except Exception as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                raise FileExistsError(path) from exc
            raise

    def open(self, key: str) -> Reader | None:
        self.counters.add(requests=1)
        try:
            # start=0 (by keyword: s3fs's second positional is version_id) makes s3fs
            # send one ranged GET instead of HEAD + GET, and a miss costs one request
            # instead of HEAD + LIST
            data = self._retry("reading", key, self._cat, self._path(key))
        except FileNotFoundError:
            return None
        self.counters.add(read=len(data))
        return _BytesReader(data)

    def _cat(self, path: str) -> bytes:
        return self.fs.cat_file(path, start=0)

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return
        self.counters.add(requests=1 + len(paths) // 1000)
        try:
            self._retry("deleting", paths[0], self.fs.rm, paths)
        except FileNotFoundError:
            for path in paths:  # some backends stop at the first missing one
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        base = self._path(prefix)
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        strip = len(self.root) + 1
        return sorted((p[strip:], int(info.get("size") or 0)) for p, info in found.items())

    def probe_bucket(self) -> None:
        """Fail early when the bucket (or container) is missing or unreadable."""
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if proto in ("memory",):
            return
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.ls(bucket, refresh=True) if _accepts_refresh(self.fs) else self.fs.ls(bucket)
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


def _accepts_refresh(fs) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.ls).parameters
    except (TypeError, ValueError):
        return False


# Filesystems whose page cache is the only cache: rewriting a file in place is seen by
# every reader at once. Network and FUSE filesystems are excluded on purpose.
_LOCAL_FS = {"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs",
             "overlay", "jfs", "reiserfs", "bcachefs"}


def is_local_filesystem(path: str) -> bool:
    """True when ``path`` lies on a local filesystem (per /proc/self/mountinfo)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return False  # not Linux: be conservative
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best, fstype = "", None
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount_point = fields[4].replace("\\040", " ")
        if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) and len(
            mount_point
        ) >= len(best):
            best, fstype = mount_point, right.split()[0]
    return fstype in _LOCAL_FS


def split_url(url: str) -> tuple[str, str]:
    """(protocol, rest). A bare path, or ``file://``, is protocol "file"."""
    if "://" not in url:
        return "file", url
    parts = urlsplit(url)
    return parts.scheme.lower(), url.split("://", 1)[1]


def open_storage(url: str, storage_options: dict | None = None) -> Storage:
    """Storage for ``url``. Validates the URL; does no I/O on object stores yet."""
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
        from fsspec.registry import known_implementations
    except ImportError as exc:  # pragma: no cover - fsspec is a hard dependency
        raise ConfigError("fsspec is not installed", hint="pip install fsspec") from exc
    if protocol not in known_implementations and protocol not in fsspec.available_protocols():
        raise ConfigError(
            f"unknown URL scheme {protocol!r} in {url!r}",
            hint="use a directory path, file://, an fsspec URL (s3://, gs://, memory://) "
            "or gloo://, nccl://, torch://",
        )
    retries = None
    if protocol == "s3":
        # One retry layer, not three multiplied (botocore x s3fs x ours took 2 minutes
        # to report a dead endpoint): botocore's adaptive mode backs off on 503 SlowDown
        # and connection errors; s3fs and ferrosync then try once.
        config = dict(storage_options.get("config_kwargs") or {})
        config.setdefault("retries", {"mode": "adaptive", "max_attempts": 5})
        config.setdefault("connect_timeout", 5)
        config.setdefault("read_timeout", 60)
        storage_options["config_kwargs"] = config
        retries = 0
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        package = {"s3": "'ferrosync[s3]' (s3fs)", "gs": "gcsfs", "gcs": "gcsfs",
                   "az": "adlfs", "abfs": "adlfs"}.get(protocol)
        fix = f"pip install {package}" if package else (
            known_implementations.get(protocol, {}).get("err")
            or f"install the fsspec driver for {protocol}")
        raise ConfigError(
            f"the {protocol}:// driver is not installed ({exc})", path=url, hint=fix
        ) from None
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
    storage = FsspecStorage(url, fs, root)
    if retries is not None:
        storage.retries = retries
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own loop: a single attempt, botocore retries

    return storage



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


def object_exists(storage: Storage, key: str) -> bool:
    """Exact-name existence by opening it: errors other than "not found" propagate."""
    reader = storage.open(key)
    if reader is None:
        return False
    reader.close()
    return True
