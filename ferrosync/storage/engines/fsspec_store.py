"""The object-store engine: ``FsspecStorage`` over any fsspec filesystem that is not a
local directory (s3://, gs://, az://, memory://, a registered driver), and the openers
that build one for a URL (``open_fsspec``, ``open_gcs`` with gcsfs's driver choice).

One PUT is an atomic publish; ``put(exclusive=True)`` is the driver's create-if-absent
(a driver that cannot is refused, never degraded to an overwrite). S3's own conditional
PUT and client settings are in ``s3``, a subclass of this engine.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence
from urllib.parse import urlsplit

from ferrosync.errors import ConfigError, FerrosyncError, ShardCorrupt, StorageError
from ferrosync.storage import names
from ferrosync.storage.engines.base import (
    EXCLUSIVE_CREATE_HINT,
    BytesReader,
    ExclusiveCreateUnsupported,
    Reader,
    Storage,
    check_key,
    oversized,
)
from ferrosync.storage.engines.classify import (
    causes,
    http_status,
    is_transient,
    s3_code,
    s3_response,
    storage_error,
)
from ferrosync.storage.engines.parts import (
    MAGIC,
    MANIFEST_LIMIT,
    PREFIX,
    Manifest,
    PartsReader,
    Transfer,
    body_of,
    chunks,
    encode_manifest,
    manifest_length,
    new_token,
    parse_manifest,
    run_window,
)
from ferrosync_schemes import scheme

_log = logging.getLogger(__name__)
#: manifests remembered per store (to delete their parts with them): the newest ones
_REMEMBERED = 4096


def generic_create(cls) -> str | None:
    """Why the driver class ``cls`` cannot create exclusively, where the class alone says so: a
    synchronous driver that keeps fsspec's generic ``pipe_file``, whose
    ``mode="create"`` is ``exists()`` and then a plain write, so two writers can both
    pass the check and both "create". None where the driver has its own create (which
    connect's probe then tries on the location)."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    if issubclass(cls, AsyncFileSystem) or cls.pipe_file is not AbstractFileSystem.pipe_file:
        return None
    return (f"the {cls.__name__} driver keeps fsspec's generic pipe_file, whose create "
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


def precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is an HTTP 412 (PreconditionFailed) from a conditional write
    (or the driver's own ``FileExistsError`` for it)."""
    if s3_response(exc) is not None:
        return http_status(exc) == 412 or s3_code(exc) == "PreconditionFailed"
    return isinstance(exc, FileExistsError) or http_status(exc) == 412


class FsspecStorage(Storage):
    """Any fsspec filesystem that is not local: s3://, gs://, memory://, ..."""

    poll_initial = 5e-3
    poll_max = 0.2
    heartbeat_interval = 2.0
    #: each read of an object store is a billed GET per rank: about 2 per second
    watch_poll = 0.5
    round_trips_dominate = True
    #: how one object moves: the largest request, the part size, parts in flight
    #: (``parts.Transfer``; ``set_transfer`` changes them for one store)
    transfer = Transfer()
    #: ``put(exclusive=True)`` is the engine's own conditional request
    #: (``_create_if_absent``) rather than the driver's ``pipe_file(mode="create")``
    _conditional_put = False
    #: what to check when the first contact finds no usable credentials / no answer
    _credentials_hint = "check the credentials the driver uses"
    _unreachable_hint = "check that the store is reachable from this host"

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
            self.shared_between_processes = False  # this process's dictionary
        #: why this driver cannot create exclusively, where its class says so already
        self._no_create = None if self._conditional_put else generic_create(type(fs))
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        #: objects written or read in parts here: key -> (write token, parts)
        self._manifests: dict[str, tuple[str, int]] = {}

    def fs_path(self, key: str) -> str:
        """``key``'s path as the fsspec driver names it (no scheme): what this engine
        and its subclasses hand ``self.fs``."""
        return f"{self.root}/{check_key(key)}" if key else self.root

    def set_transfer(self, *, max_request_bytes: int | None = None,
                     part_bytes: int | None = None, concurrency: int | None = None) -> None:
        self.transfer = self.transfer.replace(max_request_bytes=max_request_bytes,
                                              part_bytes=part_bytes, concurrency=concurrency)

    def _executor(self) -> ThreadPoolExecutor:
        """The threads that move parts and ranges (made on first use, ended by close)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.transfer.concurrency,
                                                thread_name_prefix="ferrosync-parts")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def put(self, key: str, parts: Sequence, *, exclusive: bool = False,
            reuse: str | None = None) -> int:
        if reuse is not None:
            self.delete([reuse])  # an object store has nothing to recycle
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        if size > self.transfer.part or _starts_like_manifest(views):
            # larger than one part (or, rarely, bytes that would read as a manifest)
            return self._put_parts(key, views, size, exclusive)
        replaced = None if exclusive else self._forget(key)
        self._put_one(key, body_of(views) if views else b"", exclusive)
        if replaced is not None:
            self._drop_parts(key, *replaced)
        return size

    def _put_one(self, key: str, data: bytes, exclusive: bool) -> None:
        """One PUT of ``data`` at ``key`` (a create only if absent with ``exclusive``)."""
        path = self.fs_path(key)
        if exclusive and self._conditional_put:
            self.exclusive_create(key, [data], lambda: self.retry(
                "creating", key, self._create_if_absent, key, path, data))
        elif exclusive and self._no_create:
            raise ExclusiveCreateUnsupported(self._no_create, path=self.path_of(key),
                                             hint=EXCLUSIVE_CREATE_HINT)
        elif exclusive:
            self.exclusive_create(key, [data], lambda: self._write(key, path, data, "create"))
        else:
            self._write(key, path, data, "overwrite")
        self.counters.add(puts=1, written=len(data))

    def _put_parts(self, key: str, views: list, size: int, exclusive: bool) -> int:
        """``views`` as part objects, ``concurrency`` PUTs at a time, then the manifest
        at ``key`` as the last step (``parts``); an aborted write removes what it
        wrote (what it cannot is ``gc``'s)."""
        if exclusive and not self._conditional_put and self._no_create:
            raise ExclusiveCreateUnsupported(self._no_create, path=self.path_of(key),
                                             hint=EXCLUSIVE_CREATE_HINT)
        part, token = self.transfer.part, new_token()
        count = -(-size // part)
        sizes = [part] * (count - 1) + [size - part * (count - 1)]

        def write(index: int, pieces: list) -> None:
            part_key = self._part_key(key, token, index)
            self._write_part(part_key, pieces)
            self.counters.add(puts=1, written=sum(p.nbytes for p in pieces))

        replaced = None if exclusive else self._forget(key)
        try:
            run_window(self._executor(), (
                functools.partial(write, i, pieces)
                for i, (_, pieces) in enumerate(chunks(views, part))), self.transfer.concurrency)
        except BaseException:
            self._drop_parts(key, token, count)
            raise
        try:
            self._put_one(key, encode_manifest(token, sizes), exclusive)
        except FileExistsError:
            self._drop_parts(key, token, count)  # another writer's object holds the name
            raise
        # any other failure: the manifest may have landed all the same (its reply lost,
        # then a resend failed), so its parts stay; if it did not, gc finds them orphaned
        self._remember(key, token, count)
        if replaced is not None:
            self._drop_parts(key, *replaced)
        return size

    def _write_part(self, key: str, pieces: list) -> None:
        """One part's PUT. fsspec's drivers take ``bytes``: one part's copy (an engine
        whose client streams a file-like body overrides it)."""
        self._write(key, self.fs_path(key), body_of(pieces), "overwrite")

    @staticmethod
    def _part_key(key: str, token: str, index: int) -> str:
        directory, _, name = key.rpartition("/")
        return names.within(directory, names.part(name, token, index))

    def _remember(self, key: str, token: str, count: int) -> None:
        """Keep ``key``'s parts (written or read here) to delete them with it."""
        with self._lock:
            self._manifests[key] = (token, count)
            while len(self._manifests) > _REMEMBERED:
                self._manifests.pop(next(iter(self._manifests)))

    def _forget(self, key: str) -> tuple[str, int] | None:
        with self._lock:
            return self._manifests.pop(key, None)

    def _drop_parts(self, key: str, token: str, count: int) -> None:
        """Delete the parts of one write of ``key``, where we can: a failure leaves
        them to ``gc`` (their manifest is gone or names another write)."""
        try:
            self.delete([self._part_key(key, token, i) for i in range(count)])
        except Exception:  # noqa: BLE001 - best effort: gc collects orphan parts
            _log.warning("could not delete the %d parts of %s; `ferrosync gc` removes them",
                         count, self.path_of(key))

    def _write(self, key: str, path: str, data: bytes, mode: str) -> None:
        """``pipe_file`` in ``mode`` (retried), making the parent where a driver needs it."""
        try:
            self.retry("writing", key, self._pipe, key, path, data, mode)
        except FileNotFoundError:
            # a driver with real directories and no auto-mkdir (sftp, a local
            # filesystem class): its parent is made on demand, then once more
            self._make_parent(key, path)
            try:
                self.retry("writing", key, self._pipe, key, path, data, mode)
            except FileNotFoundError as exc:
                raise StorageError(
                    f"cannot write: its directory does not exist ({exc})",
                    path=self.path_of(key), hint="check that the URL is a writable "
                    "location, and that nothing removes directories under it") from None

    def _make_parent(self, key: str, path: str) -> None:
        parent = path.rpartition("/")[0]
        if parent:
            self.counters.add(requests=1)
            try:
                self.retry("creating the directory", key, self.fs.makedirs, parent,
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
            if mode == "create" and precondition_failed(exc):
                raise FileExistsError(errno.EEXIST, "the object exists already",
                                      self.path_of(key)) from exc
            raise

    def _create_if_absent(self, key: str, path: str, data: bytes) -> None:
        """Create ``path`` only if absent, in one conditional request (``FileExistsError``
        when it exists); engines with ``_conditional_put`` implement it."""
        raise NotImplementedError

    def open(self, key: str, *, max_bytes: int | None = None,
             rank: int | None = None) -> Reader | None:
        """One GET of at most a part (bounded: of at most ``max_bytes + 1`` bytes, so
        an oversized object costs that, never its claimed size): the whole of a small
        object; a manifest, whose parts are then read ``concurrency`` at a time; or the
        first part of a large plain object, read on in ranges of a part."""
        part = self.transfer.part
        end = part if max_bytes is None else min(max_bytes + 1, part)
        try:
            data = self._get(key, 0, end)
        except FileNotFoundError:
            return None
        if data[:len(MAGIC)] == MAGIC:
            return self._open_parts(key, data, end, max_bytes, rank)
        if len(data) < end:
            return BytesReader(data)
        if max_bytes is not None and end == max_bytes + 1:
            raise oversized(self.path_of(key), None, max_bytes, rank)
        size = self._size_of(key)
        if size is None:  # removed since the GET
            return None
        self.check_size(key, size, max_bytes, rank)
        if size <= len(data):
            return BytesReader(data)
        offsets = range(len(data), size, part)
        sizes = [len(data)] + [min(part, size - o) for o in offsets]
        starts = [0, *offsets]
        return PartsReader(sizes, lambda i, view: self._piece_into(key, starts[i], view, rank),
                           self._executor(), self.transfer.concurrency, first=data)

    def _get(self, key: str, start: int, end: int | None) -> bytes:
        """One counted GET of ``key``'s bytes ``[start, end)`` (all from ``start``: None)."""
        self.counters.add(gets=1)
        data = self.retry("reading", key, self._cat, self.fs_path(key), end, start)
        self.counters.add(read=len(data))
        return data

    def _get_into(self, key: str, start: int, view: memoryview, extra: int) -> int:
        """One GET of ``key``'s bytes from ``start`` into ``view``, asking for ``extra``
        bytes more than it holds: how many the object had there (up to
        ``view.nbytes + extra``; those past ``view`` are not kept). Retried whole: a
        retry fills ``view`` again from its start. This driver's reply is one ``bytes``
        (a part's copy, dropped here); an engine that streams a body overrides it."""
        data = self.retry("reading", key, self._cat, self.fs_path(key),
                           start + view.nbytes + extra, start)
        n = min(len(data), view.nbytes)
        view[:n] = memoryview(data)[:n]
        return len(data)

    def _piece_into(self, key: str, start: int, view: memoryview, rank: int | None, *,
                    whole: bool = False) -> None:
        """Fill ``view`` with exactly its size of ``key``'s bytes from ``start``: a range
        of a large object, or with ``whole`` all of a part object (one byte more is
        asked for: a longer part is refused). One counted GET. It must be there: its
        manifest or its first bytes were."""
        self.counters.add(gets=1)
        try:
            got = self._get_into(key, start, view, int(whole))
        except FileNotFoundError:
            raise StorageError(
                "a part of this object vanished while it was read", rank=rank,
                path=self.path_of(key),
                hint="something removed it while a rank read it: give every job its own "
                "location, and run `ferrosync gc` only with its watch window") from None
        self.counters.add(read=got)
        if got != view.nbytes:
            raise ShardCorrupt(
                f"object part at byte {start} has {'more than ' if got > view.nbytes else ''}"
                f"{min(got, view.nbytes)} bytes, {view.nbytes} expected (changed while "
                "read, or not ferrosync's)", rank=rank, path=self.path_of(key),
                hint="give every job a location only its own ranks can write")

    def _piece(self, key: str, start: int, nbytes: int, rank: int | None, *,
               whole: bool = False) -> bytearray:
        """``_piece_into`` a buffer of its own."""
        buf = bytearray(nbytes)
        self._piece_into(key, start, memoryview(buf), rank, whole=whole)
        return buf

    def _size_of(self, key: str) -> int | None:
        """The object's size (one HEAD), None when it does not exist."""
        path = self.fs_path(key)
        self.counters.add(gets=1)
        self.fs.invalidate_cache(path)
        try:
            info = self.retry("reading", key, self.fs.info, path)
        except FileNotFoundError:
            return None
        return int(info.get("size") or 0)

    def _open_parts(self, key: str, data: bytes, end: int, max_bytes: int | None,
                    rank: int | None) -> Reader:
        """The reader of the object whose manifest starts with ``data``."""
        manifest = self._manifest(key, data, end, rank)
        self.check_size(key, manifest.size, max_bytes, rank)
        self._remember(key, manifest.token, len(manifest.sizes))
        part_keys = [self._part_key(key, manifest.token, i) for i in range(len(manifest.sizes))]
        return PartsReader(manifest.sizes,
                           lambda i, view: self._piece_into(part_keys[i], 0, view, rank,
                                                            whole=True),
                           self._executor(), self.transfer.concurrency)

    def _manifest(self, key: str, data: bytes, end: int, rank: int | None) -> Manifest:
        """The manifest ``data`` begins (read on where the first GET held less of it)."""
        need = manifest_length(data) if len(data) >= PREFIX else PREFIX
        if len(data) == end and need > len(data) and need <= MANIFEST_LIMIT:
            data = data + self._get(key, len(data), need + 1)
        return parse_manifest(data, path=self.path_of(key), rank=rank)

    def read_head(self, key: str, nbytes: int, *, rank: int | None = None) -> bytes | None:
        """The object's first ``nbytes`` bytes: one ranged GET of a plain object; of a
        written-in-parts one, its manifest and then its first part(s), that far."""
        data = self._raw_head(key, nbytes)
        if data is None:
            return None
        if len(data) == nbytes < PREFIX and MAGIC.startswith(data[:len(MAGIC)]):
            data = self._raw_head(key, PREFIX)  # too short to tell: a manifest's start?
            if data is None:
                return None
        if data[:len(MAGIC)] != MAGIC:
            return data[:nbytes]
        manifest = self._manifest(key, data, len(data), rank)
        out, left = [], nbytes
        for index, size in enumerate(manifest.sizes):
            if left <= 0:
                break
            take = min(size, left)
            out.append(self._piece(self._part_key(key, manifest.token, index), 0, take, rank,
                                   whole=take == size))
            left -= take
        return b"".join(out)

    def _raw_head(self, key: str, nbytes: int) -> bytes | None:
        """The stored object's own first ``nbytes`` bytes (a manifest as it is)."""
        try:
            return self._get(key, 0, max(nbytes, 1))[:nbytes]
        except FileNotFoundError:
            return None

    def _cat(self, path: str, end: int | None = None, start: int = 0) -> bytes:
        # start by keyword (s3fs's second positional is version_id): s3fs then sends one
        # ranged GET instead of HEAD + GET, and a miss costs one request, not HEAD + LIST
        if end is None:
            return self.fs.cat_file(path, start=start)
        return self.fs.cat_file(path, start=start, end=end)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in list(keys):  # an object written in parts goes with its parts
            found = self._forget(key)
            if found is not None:
                keys.extend(self._part_key(key, found[0], i) for i in range(found[1]))
        if not keys:
            return
        paths = [self.fs_path(k) for k in keys]
        self.counters.add(deletes=1 + len(paths) // 1000)  # one DeleteObjects per 1000
        # errors name the key (``retry`` makes the full URL of it), never the fs path
        what = "deleting" if len(keys) == 1 else f"deleting {len(keys)} objects"
        try:
            self.retry(what, keys[0], self.fs.rm, paths)
        except FileNotFoundError:
            for key, path in zip(keys, paths):  # some backends stop at the first missing one
                try:
                    self.retry("deleting", key, self.fs.rm_file, path)
                except FileNotFoundError:
                    pass

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        base = self.fs_path(prefix)
        self.fs.invalidate_cache()
        self.counters.add(lists=1)  # at least one: a LIST page holds up to 1000 keys
        try:
            found = self.retry("listing", prefix, self.fs.find, base, detail=True)
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
        names = {type(c).__name__ for c in causes(exc)}
        code = s3_code(exc)
        if names & _NO_CREDENTIALS or code in _BAD_CREDENTIALS:
            return ConfigError(
                f"no usable credentials for {where} ({cause})", path=self.url,
                hint=self._credentials_hint)
        if names & _TIMED_OUT or isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            return ConfigError(
                f"no answer from {where} within "
                f"{self.first_contact_timeout or 'the driver timeout'} s ({cause})",
                path=self.url, hint=self._unreachable_hint)
        if is_transient(exc) or names & _UNREACHABLE:
            return ConfigError(
                f"cannot reach {where} ({cause})", path=self.url,
                hint=self._unreachable_hint)
        return storage_error("contacting the store", self.url, exc, False)


# first-contact failures, by the class names of the errors behind them (botocore's and
# aiohttp's, which need not be installed)
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "NoAuthTokenError"}
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                    "InvalidToken", "TokenRefreshRequired"}
_TIMED_OUT = {"ConnectTimeoutError", "ReadTimeoutError", "FSTimeoutError"}
_UNREACHABLE = {"EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError",
                "ClientOSError", "gaierror"}


def _starts_like_manifest(views: list) -> bool:
    """Whether the concatenation of ``views`` starts with a manifest's magic."""
    head = b"".join(v[:len(MAGIC)].tobytes() for v in views[:len(MAGIC)])
    return head[:len(MAGIC)] == MAGIC


def _accepts_refresh(fs) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.ls).parameters
    except (TypeError, ValueError):
        return False


def _driver_hint(protocol: str, exc: BaseException) -> str:
    """The ``pip install`` that adds ``protocol``'s fsspec driver: the table of schemes'
    (``ferrosync_schemes``), else from fsspec's own ``known_implementations`` (the
    driver's package, or for drivers inside fsspec the module its import missed)."""
    from fsspec.registry import known_implementations

    install = scheme(protocol).install
    if install:
        return install
    module = str(known_implementations.get(protocol, {}).get("class", "")).split(".")[0]
    if module and module != "fsspec":
        return f"pip install {module.replace('_', '-')}"
    for cause in causes(exc):
        name = getattr(cause, "name", None)
        if isinstance(cause, ImportError) and name:
            return f"pip install {name.split('.')[0].replace('_', '-')}"
    err = known_implementations.get(protocol, {}).get("err")
    return f"install the fsspec driver for {protocol}://" + (f" ({err})" if err else "")


# -- opening a URL (the table in ``ferrosync.storage.engines`` maps a scheme to an opener) ---------

def driver_class(url: str, protocol: str):
    """The fsspec filesystem class for ``protocol``, imported now (what follows may import
    its client, botocore for s3://); ``ConfigError`` for an unknown scheme or a driver
    that is not installed, with the ``pip install`` that adds it."""
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
    try:
        return fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"the {protocol}:// driver is not installed ({exc})", path=url,
            hint=_driver_hint(protocol, exc),
        ) from None


def build(url: str, protocol: str, cls, storage_options: dict, timeout: float | None,
          engine: type[FsspecStorage] = FsspecStorage) -> FsspecStorage:
    """``engine`` over a new ``cls`` filesystem made with ``storage_options``; no I/O."""
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
    storage = engine(url, fs, root)
    storage.first_contact_timeout = timeout
    return storage


def open_fsspec(url: str, protocol: str, rest: str, storage_options: dict,
                timeout: float | None) -> FsspecStorage:
    """Any fsspec URL without an opener of its own (memory://, az://, a registered
    driver)."""
    return build(url, protocol, driver_class(url, protocol), storage_options, timeout)


def open_gcs(url: str, protocol: str, rest: str, storage_options: dict,
             timeout: float | None) -> FsspecStorage:
    """gs:// and gcs://: gcsfs, with its JSON API driver off Google's endpoint."""
    cls = gcs_driver(driver_class(url, protocol), storage_options)
    return build(url, protocol, cls, storage_options, timeout)
