"""The storage interface every engine implements, and what all callers share.

``Storage`` (put / open / read / read_head / delete / park / makedirs / list, counted in
``Counters``, transient failures retried by ``retry``, an exclusive create whose reply
was lost recognised as ours by ``exclusive_create``), ``Reader``, the size rule
(``RECORD_LIMIT``, ``oversized``), key validation (``check_key``), ``Backoff`` for polling
one exact name (from ``ferrosync.core.runtime``), ``object_exists`` and ``probe_location``,
the one probe every caller runs before a job writes anything. The engines live beside it:
``local`` (directories), ``fsspec_store`` (object stores) and ``s3``;
``ferrosync.storage.engines.open_storage`` picks one for a URL.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Iterable, Sequence

from ferrosync.core.runtime import Backoff  # noqa: F401 - re-exported: the engines' poll
from ferrosync.errors import ConfigError, ExclusiveCreateUnsupported, ShardCorrupt, StorageError
from ferrosync.storage import names
from ferrosync.storage.engines.classify import is_transient, storage_error

#: the largest control record (rendezvous, heartbeat, abort marker, layout, error
#: record): ``Storage.read``'s default bound. A larger object at such a name is not
#: ferrosync's (planted, or a sparse file), and is refused before it is read.
RECORD_LIMIT = 1 << 20


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


#: request kinds an object store bills differently (``storage/costs.py``); ``requests`` counts
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

    def readall(self) -> bytes:
        """The object's remaining bytes (at most ``size``) as one ``bytes``: what
        ``Storage.read`` returns. Costs the object's size twice over here (a buffer,
        then its bytes); readers that can fill one ``bytes`` in place (a local file up
        to 2 GiB, an object store's GET) override it to cost it once."""
        buf = bytearray(self.size)
        n = self.readinto(buf)
        del buf[n:]  # in place: a short object costs no second copy
        return bytes(buf)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BytesReader(Reader):
    """A ``Reader`` over bytes already in memory: an object store's GET, or an object
    a caller kept from an existence check."""

    def __init__(self, data) -> None:
        self._whole = data
        self._data = memoryview(data).cast("B")
        self._pos = 0
        self.size = len(self._data)

    def readall(self) -> bytes:
        if self._pos == 0 and isinstance(self._whole, bytes):
            self._pos = self.size
            return self._whole  # the GET's own bytes: no copy
        return super().readall()

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = min(len(view), self.size - self._pos)
        view[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._data.release()
        self._whole = b""  # the bytes go with the reader, not with a stray reference


class Storage:
    """Base class: the counters, retries and the interface every store implements."""

    #: polling back-off for this kind of store: (first sleep, cap), seconds
    poll_initial: float = 50e-6
    poll_max: float = 0.02
    #: heartbeat period that keeps request counts sane on this kind of store
    heartbeat_interval: float = 1.0
    #: how long the operator tools watch heartbeats by default, in heartbeat periods
    #: (two beats seen, short enough for an interactive tool), and how often they read
    #: them (``ops/watch.py``)
    watch_periods: float = 2.5
    watch_poll: float = 0.1
    retries: int = 4
    #: seconds one call may spend retrying (``open_storage``'s timeout); None: no bound
    #: but ``retries``
    retry_s: float | None = None
    #: where ``retry`` reads time and sleeps (a ``runtime.Runtime``; None: the ``time``
    #: module): the elastic simulator's storage runs on virtual time
    runtime = None

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
    #: what one process stores, another sees (False: ``memory://``, one process's own)
    shared_between_processes: bool = True

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
            return reader.readall()

    def read_head(self, key: str, nbytes: int, *, rank: int | None = None) -> bytes | None:
        """The first ``nbytes`` bytes of ``key``'s object (all of it when shorter), or
        None if it does not exist: what a caller that needs only a header reads (``ferrosync
        inspect --objects``), whatever the object's size. One request: a ranged GET on an
        object store, ``nbytes`` read from the open file locally.

        This default reads through ``open``; an engine whose reader holds the whole object
        (object stores) overrides it with a ranged read.
        """
        reader = self.open(key, rank=rank)
        if reader is None:
            return None
        with reader:
            buf = bytearray(min(nbytes, reader.size))
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

    # -- what every engine shares (called by engines, not by the object layer) --------
    def check_size(self, key: str, size: int, max_bytes: int | None,
                   rank: int | None) -> None:
        """Refuse an object larger than the largest legal one of its kind."""
        if max_bytes is not None and size > max_bytes:
            raise oversized(self.path_of(key), size, max_bytes, rank)

    def retry(self, what: str, key: str, fn, *args, **kwargs):
        """Run ``fn``; retry the failures ``_retryable`` admits with bounded exponential
        back-off: at most ``retries`` times, and never past ``retry_s`` seconds from the
        first try (``open_storage``'s timeout), so a call fails within its deadline.

        "Not found" (FileNotFoundError) and FileExistsError are answers, not failures,
        and pass straight through; so do permanent errors, wrapped with the path
        and a hint so the caller can say what to do (a StorageError ``fn`` raised
        itself already says it). Every request ferrosync makes may be sent again: reads,
        lists and deletes are idempotent, a put rewrites the same bytes, and an exclusive
        create that finds its own bytes is recognised as ours (``exclusive_create``).
        """
        delay, clock = 0.05, self.runtime or time
        give_up = None if self.retry_s is None else clock.monotonic() + self.retry_s
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, FileExistsError, StorageError):
                raise
            except Exception as exc:  # botocore/aiohttp errors are not all OSErrors
                if (not self._retryable(exc) or attempt == self.retries or (
                        give_up is not None and clock.monotonic() + delay > give_up)):
                    raise storage_error(what, self.path_of(key), exc,
                                        is_transient(exc)) from exc
                self._recover()
                clock.sleep(delay)
                delay = min(delay * 4, 2.0)
        raise AssertionError("unreachable")

    def _retryable(self, exc: BaseException) -> bool:
        """Hook: whether ``retry`` tries again after ``exc``: any transient failure
        (``classify.is_transient``), unless the engine's client retried it already."""
        return is_transient(exc)

    def exclusive_create(self, key: str, parts: Sequence, create) -> bool:
        """Run ``create()``, the engine's create-if-absent of ``parts`` at ``key`` (its
        ``put(exclusive=True)`` calls this; callers above the engines call that ``put``). An
        "exists" answer (FileExistsError) over exactly our bytes is our own create:
        whoever sent it again. The one home of own-write recognition, for every engine.
        Returns True where the create was recognised so (an earlier attempt landed).

        A create whose reply is lost lands all the same, and is then sent again, by the
        client library underneath (aiohttp resends an idempotent PUT once; botocore,
        gcsfs and azure retry a reset connection; NFS retransmits a LINK), or by
        ``retry``: the second attempt finds the object and answers 412, 409 or EEXIST,
        with nothing to say who made it. So on every "exists" the object is read back,
        bounded to ``len(parts) + 1`` bytes (one ranged GET: a larger object is not
        ours, and costs no more), and compared.

        Cost: one small GET per lost race. Correctness: bytes identical to ours from
        another writer are, by construction, the same record: every exclusively
        created object whose winner matters names its writer in its bytes (a
        rendezvous claim its random token, an elastic join entry or member record the
        member's random id, a contribution its rank, generation and collective, a
        generation record its token), so only we can have written them. The rest are
        records that any writer of that name writes identically (an elastic roster
        computed from the same round, a job's spec, an end marker): readers cannot
        tell the writers apart and act the same whichever won, so claiming the win
        changes nothing they see.
        """
        try:
            create()
        except FileExistsError:
            if not self._holds(key, parts):
                raise
            return True
        return False

    def _holds(self, key: str, parts: Sequence) -> bool:
        """Whether the object at ``key`` holds exactly the bytes of ``parts``."""
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        stored = self._raw_head(key, size + 1)
        if stored is None or len(stored) != size:
            return False
        offset = 0
        for view in views:
            if stored[offset:offset + view.nbytes] != view:
                return False
            offset += view.nbytes
        return True

    def _raw_head(self, key: str, nbytes: int) -> bytes | None:
        """Hook: the stored object's own first ``nbytes`` bytes, as ``_holds`` compares them
        (an engine that stores large objects as a manifest and parts: the manifest)."""
        return self.read_head(key, nbytes)

    def set_transfer(self, *, max_request_bytes: int | None = None,
                     part_bytes: int | None = None, concurrency: int | None = None) -> None:
        """How an object store moves one object (``storage/engines/parts.py``): the largest
        request body, the part size and the parts in flight (None: kept). A directory
        has no request to bound: ignored."""

    def _recover(self) -> None:
        """Hook: before retrying a transient failure: drop state the failure may have made
        stale (LocalStorage: directory handles of removed directories)."""


#: what to do about a store without exclusive create (its ConfigError and StorageError)
EXCLUSIVE_CREATE_HINT = (
    "use a driver that creates only if absent (s3fs with botocore >= 1.35.20, gcsfs, "
    "adlfs: docs/operations.md#object-stores), and run `ferrosync doctor URL` to see "
    "what this store supports")


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
    # random names and bytes; a simulated store's runtime draws them from its seed
    token = storage.runtime.token_hex if storage.runtime is not None else secrets.token_hex
    key = names.probe(0 if rank is None else rank, token(4))
    payload = b"ferrosync probe " + token(8).encode()
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
