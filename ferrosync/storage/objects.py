"""The object layer of every storage-backed backend, and one fixed-size generation on it.

``Objects`` is the one place where objects and control records meet the storage: it
seals and creates, reads bounded and verified, and waits on exact names
(docs/design.md#one-object-layer). ``GenerationObjects`` adds what one generation of a
fixed-size job needs: the collective sequence and its deadline, recycling, the peers'
liveness while waiting, error and layout records. Used only by the thread inside a
collective.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from ferrosync.core import runtime as runtimes
from ferrosync.core.common import MISMATCH_HINT, describe_mismatch
from ferrosync.errors import (
    LayoutMismatch,
    PeerFailed,
    ShardCorrupt,
    SyncTimeout,
    error_class,
    relay_text,
    relayed,
)
from ferrosync.storage import names
from ferrosync.storage.engines import RECORD_LIMIT, BytesReader, Storage, object_exists
from ferrosync.storage.incoming import Expected, Incoming, read_header
from ferrosync.storage.recycler import Recycler
from ferrosync.storage.wire import (
    DTYPE_CODES,
    KIND_ERROR,
    Header,
    OpenedRecord,
    PayloadCheck,
    decode_record,
    encode_record,
    head_size,
    loads_bounded,
    open_record,
    parse_header,
    seal,
)

_log = logging.getLogger(__name__)


class Objects:
    """Sealed objects and control records under ``prefix`` on ``storage``.

    ``key`` seals and verifies (None: checksums only); ``tag`` is the 64-bit value every
    object's header carries in its generation field (a generation's token, an elastic
    job's tag: ``tag_name`` says which in messages); ``poll`` the back-off of
    ``wait_for``; ``rank`` names the reader in errors (an elastic member's changes).
    ``before_put(op)`` is called before an object is written and may raise (the owning
    ``GradSync``'s rule that nothing is published once it failed); ``op`` names the
    collective being run. ``runtime`` (default ``runtime.DEFAULT``, read at each use)
    is where time, sleeps and waits come from, for this layer and the elastic layer
    above it (the simulator passes a virtual one).
    """

    def __init__(self, storage, prefix: str, *, key: bytes | None, tag: int,
                 poll: tuple[float, float], rank: int | None = None,
                 tag_name: str = "generation", runtime=None) -> None:
        self._runtime = runtime
        self.storage = storage
        self.prefix = prefix
        self.key = key
        self.tag = tag
        self.poll = poll
        self.rank = rank
        self.tag_name = tag_name
        self.op = ""
        self.before_put = lambda op: None

    @classmethod
    def for_records(cls, storage, prefix: str = "", *, key: bytes | None,
                    rank: int | None = None) -> Objects:
        """An object layer for control records and exclusive creates only (a job's
        rendezvous, heartbeats and abort markers; the operator tools): it writes no
        collective object, so its tag is 0, and it polls at the store's pace."""
        poll = (getattr(storage, "poll_initial", Storage.poll_initial),
                getattr(storage, "poll_max", Storage.poll_max))  # a test's bare store
        return cls(storage, prefix, key=key, tag=0, rank=rank, poll=poll)

    @property
    def runtime(self):
        return self._runtime if self._runtime is not None else runtimes.DEFAULT

    @property
    def head(self) -> int:
        """Bytes before the payload of every object written or read here."""
        return head_size(self.key)

    # -- naming --------------------------------------------------------------------------------
    def key_of(self, name: str) -> str:
        return names.within(self.prefix, name)

    def path_of(self, name: str) -> str:
        return self.storage.path_of(self.key_of(name))

    def place(self, name: str) -> str:
        """The key to write ``name`` at, its directory made first when the name lies in
        an elastic job's shard (``names.in_elastic_shard``): once per directory on a
        file system, nothing on an object store."""
        key = self.key_of(name)
        if names.in_elastic_shard(name):
            self.storage.makedirs(key.rpartition("/")[0])
        return key

    # -- writing -------------------------------------------------------------------------------
    def put(self, name: str, header: Header, parts: list, *, reuse: str | None = None) -> int:
        """Seal and publish one object (atomically, see ``Storage.put``), replacing
        whatever the name held; returns its size."""
        self.before_put(self.op)
        head = seal(header, parts, self.key)
        self.storage.put(self.place(name), [head, *parts], reuse=reuse)
        # collective data objects only (not heartbeats or records): what a collective
        # costs in objects
        self.storage.counters.add(objects=1)
        return len(head) + header.payload_nbytes

    def create(self, name: str, header: Header, parts: list) -> bool:
        """Seal and create one object only if the name is free: True when this writer's
        object is there now, False when another object holds the name."""
        self.before_put(self.op)
        if not self._create(self.place(name), [seal(header, parts, self.key), *parts]):
            return False
        self.storage.counters.add(objects=1)
        return True

    def put_record(self, name: str, body: dict, *, exclusive: bool = False) -> bool:
        """Write a sealed control record (``wire.encode_record``); with ``exclusive``,
        False when another record holds the name."""
        data = [encode_record(body, self.key)]
        if exclusive:
            return self._create(self.place(name), data)
        self.storage.put(self.place(name), data)
        return True

    def create_bytes(self, name: str, parts: list) -> bool:
        """Create ``name`` holding ``parts`` as they are (not sealed: ``doctor``'s probe
        of the store's exclusive create), only if the name is free; False when taken."""
        return self._create(self.key_of(name), parts)

    def _create(self, key: str, parts: list) -> bool:
        """The one exclusive put. A create whose reply was lost and that the HTTP client
        sent again finds this writer's own object: the engine recognises it by its bytes
        (``Storage.put(exclusive=True)``), so a ``FileExistsError`` here is another
        writer's object, never this writer's."""
        try:
            self.storage.put(key, parts, exclusive=True)
        except FileExistsError:
            return False
        return True

    # -- reading -------------------------------------------------------------------------------
    def read_record(self, name: str) -> dict | None:
        """The verified control record at ``name`` (bounded, MAC before parse), or None."""
        raw = self.storage.read(self.key_of(name), rank=self.rank)
        if raw is None:
            return None
        return self.record_of(raw, name)

    def record_of(self, raw: bytes, name: str) -> dict:
        """The verified control record in ``raw``, bytes already read from ``name``
        (``ShardCorrupt`` naming it when it is malformed or its MAC does not match)."""
        return decode_record(raw, self.key, path=self.path_of(name), rank=self.rank)

    def opened_record(self, raw: bytes) -> OpenedRecord:
        """The control record in ``raw`` and how far it can be trusted with this
        layer's key (``wire.open_record``; never raises): for a reader that reports a
        foreign record rather than failing on it (the operator tools, a job's record)."""
        return open_record(raw, self.key)

    def inspect_record(self, name: str) -> OpenedRecord | None:
        """``opened_record`` of the record at ``name``, or None when it is absent; a
        name the store refuses to read raises the store's error."""
        raw = self.storage.read(self.key_of(name), rank=self.rank)
        return None if raw is None else self.opened_record(raw)

    def open_object(self, name: str, *, max_bytes: int, collective: int,
                    tag: int | None = None) -> Incoming | None:
        """Object ``name`` of ``collective`` opened for streaming, or None while it does
        not exist: at most ``max_bytes`` (refused by its size before a byte is read),
        its header parsed and its tag (``tag``, default this layer's), collective and
        size checked; its payload is verified as it is read (``Incoming``)."""
        reader = self.storage.open(self.key_of(name), max_bytes=max_bytes, rank=self.rank)
        if reader is None:
            return None
        try:
            return self._opened(reader, self.path_of(name), collective,
                                self.tag if tag is None else tag)
        except BaseException:
            reader.close()
            raise

    def _opened(self, reader, path: str, collective: int, tag: int) -> Incoming:
        header, raw_head = read_header(reader, path, self.rank, self.key)
        self._check_place(header, collective, path, tag)
        expected = header.size + header.payload_nbytes
        if reader.size != expected:
            raise ShardCorrupt(
                f"object has {reader.size} bytes, its header says {expected}",
                rank=self.rank, collective=collective, path=path,
                hint="the object was truncated or appended to on storage")
        return Incoming(reader, header, raw_head, path, self.key, self.rank)

    def _check_place(self, header: Header, collective: int, path: str,
                     tag: int | None = None) -> None:
        tag = self.tag if tag is None else tag
        if header.generation != tag or header.collective != collective:
            raise ShardCorrupt(
                f"object belongs to {self.tag_name} tag {header.generation:016x} collective "
                f"{header.collective}, expected {tag:016x} collective {collective} (a "
                "copied or replayed object)", rank=self.rank, collective=collective,
                path=path, hint="something else writes under this URL: give each job its "
                "own id or URL, and set a secret (FERROSYNC_SECRET)")

    def read_sized(self, name: str, sizes) -> bytearray | None:
        """The bytes of object ``name`` if its size is one of ``sizes`` (the legal sizes
        of that object), None while it does not exist; another size is ``ShardCorrupt``
        before more than the largest legal size is read. Not verified: for a reader
        that verifies them later (``read_verified(data=...)``)."""
        sizes = tuple(sizes)
        reader = self.storage.open(self.key_of(name), max_bytes=max(sizes), rank=self.rank)
        if reader is None:
            return None
        with reader:
            if reader.size not in sizes:
                raise self._wrong_size(reader.size, sizes, None, self.path_of(name))
            buf = bytearray(reader.size)
            got = reader.readinto(buf)
        return buf if got == len(buf) else buf[:got]

    def read_verified(self, name: str, expected: Expected, src: int, *, sizes,
                      mismatch, other_layouts: bool = False, data=None,
                      too_large=None) -> tuple[Header, memoryview] | None:
        """Object ``name`` written by ``src`` as ``expected`` says, whole and verified, or
        None while it does not exist: (its header, its payload).

        ``sizes`` are the legal sizes of the object (known from the layout); it is read
        only at one of them, except with ``other_layouts``, where a writer of another
        layout may have written it: then an object up to twice the largest legal size
        (plus a record) is read too, verified, and reported as ``mismatch(src, digest)``
        when its header names another layout. The payload's checksum or MAC is verified
        before any header field is compared with ``expected`` (the job's tag and the
        collective first). ``data``: the object's bytes when the caller
        already holds them (fetched by an existence check). ``too_large()``, if given,
        is what an object larger than the bound gives instead of ``ShardCorrupt``."""
        sizes = tuple(sizes)
        path = self.path_of(name)
        if data is not None:
            reader = BytesReader(data)
        else:
            limit = 2 * max(sizes) + RECORD_LIMIT if other_layouts else max(sizes)
            try:
                reader = self.storage.open(self.key_of(name), max_bytes=limit,
                                           rank=self.rank)
            except ShardCorrupt:  # larger than any legal object (Storage.open's rule)
                if too_large is None:
                    raise
                return too_large()
            if reader is None:
                return None
        with reader:
            if reader.size not in sizes and not other_layouts:
                raise self._wrong_size(reader.size, sizes, expected.seq, path)
            buf = bytearray(reader.size)
            got = reader.readinto(buf)
        header = parse_header(buf[:got], path=path, rank=self.rank, key=self.key)
        if got != header.size + header.payload_nbytes:
            raise ShardCorrupt(
                f"object has {got} bytes, its header says "
                f"{header.size + header.payload_nbytes}", rank=self.rank,
                collective=expected.seq, path=path,
                hint="the object was truncated or appended to on storage")
        payload = memoryview(buf)[header.size:got]
        check = PayloadCheck(header, buf[:header.size], self.key, path, self.rank)
        check.update(payload)
        check.finish()
        self._check_place(header, expected.seq, path)
        if got not in sizes:  # verified, of another size: another layout, or not ours
            if header.layout != expected.digest:
                raise mismatch(src, header.layout)
            raise self._wrong_size(got, sizes, expected.seq, path)
        expected.check(header, src, path, self.rank, mismatch)
        return header, payload

    def _wrong_size(self, size: int, sizes, collective: int, path: str) -> ShardCorrupt:
        return ShardCorrupt(
            f"object has {size} bytes; an object of this kind has "
            f"{' or '.join(map(str, sorted(set(sizes))))}", rank=self.rank,
            collective=collective, path=path,
            hint="let nothing else write under this URL (set a secret); every rank must "
            "call the same collectives with the same layouts")

    # -- waiting -------------------------------------------------------------------------------
    def wait_for(self, attempt, *, deadline, expired, between=None,
                 poll: tuple[float, float] | None = None, sleeping=None):
        """``attempt()`` until it returns something (not None), which is returned: one
        exact name polled with back-off (``poll``, default this layer's). After each
        miss ``between()`` runs (the liveness looks; it may raise a peer's error, or
        return a value that ends the wait), then the deadline (a number, or a function
        for a deadline that moves) is judged: past it, ``expired()`` is raised.
        ``sleeping()``, if given, is a context around each sleep (a stats phase).
        The loop and the deadline rule are ``runtime.wait``'s."""
        def fail():
            raise expired()

        return runtimes.wait(attempt, deadline=deadline, expired=fail, between=between,
                             poll=poll or self.poll, sleeping=sleeping,
                             runtime=self.runtime)


class GenerationObjects(Objects):
    """The objects of generation ``generation`` below ``prefix`` on ``storage``.

    ``begin(op)`` starts collective ``seq`` and its deadline; every wait of that
    collective ends by it (restarted after the process was paused, see
    ``PeerMonitor.resumed_at``).
    """

    def __init__(self, storage, prefix: str, generation, *, rank: int, world_size: int,
                 key: bytes | None, poll: tuple[float, float], monitor, stats,
                 timeout: float, url: str) -> None:
        super().__init__(storage, prefix, key=key, tag=generation.tag, poll=poll, rank=rank)
        self.generation = generation
        self.world_size = world_size
        self.timeout = timeout
        self.recycler = Recycler(storage, world_size)
        self._monitor = monitor
        self._stats = stats
        self._url = url
        self._layouts: dict[bytes, dict] = {}
        self.seq = 0
        self.deadline = 0.0
        self.gathering: dict[int, str] | None = None  # names awaited in a gather

    # -- one collective ------------------------------------------------------------------------
    def begin(self, op: str) -> int:
        self.recycler.before_collective()
        self.seq += 1
        self.op = op
        self.deadline = time.monotonic() + self.timeout
        return self.seq

    # -- writing -------------------------------------------------------------------------------
    def put(self, name: str, header: Header, parts: list, *, reuse: str | None = None) -> int:
        """Seal and publish one collective object, rewriting a consumed file's storage
        where the store can (``Recycler``)."""
        nbytes = head_size(self.key) + header.payload_nbytes
        size = super().put(name, header, parts, reuse=self.recycler.take_spare(nbytes))
        self.recycler.written(self.key_of(name), size)
        return size

    def publish_error(self, name: str, exc: BaseException) -> None:
        """Publish an error record where peers wait, so they fail now, not at timeout."""
        body = json.dumps({"type": type(exc).__name__, "message": relay_text(exc)})
        payload = body.encode()
        header = Header(
            kind=KIND_ERROR, dtype=DTYPE_CODES[torch.uint8], codec=0, rank=self.rank,
            world_size=self.world_size, generation=self.generation.tag,
            collective=self.seq, count=len(payload), offset=0, total=len(payload),
            weight=0.0, layout=b"\0" * 8, payload_nbytes=len(payload),
        )
        try:
            self.put(name, header, [payload])
        except Exception:  # noqa: BLE001 - best effort: we are already failing with exc;
            # the peers will still see our abort marker or time out
            _log.debug("rank %d: could not publish the error record %s", self.rank, name,
                       exc_info=True)

    def ensure_layout(self, digest: bytes, layout: dict) -> None:
        """Publish this rank's description of ``digest`` once, for mismatch messages."""
        if digest in self._layouts:
            return
        self._layouts[digest] = layout
        self.put_record(names.layout_record(digest, self.rank), layout)

    # -- waiting and opening -----------------------------------------------------------------
    def wait_open(self, name: str, wait_on, what: str, payload_nbytes: int) -> Incoming:
        """Block until object ``name`` exists and return it opened, header checked.

        Polls the exact name with back-off; while waiting, deletes garbage and checks
        the peers in ``wait_on`` (abort markers, heartbeats) once per interval. An
        error record raises the error its writer reported. ``payload_nbytes`` is the
        payload the layout expects: a larger object (or error record) is refused by
        its size, before a byte of its payload is read or buffered.
        """
        limit = head_size(True) + max(payload_nbytes, RECORD_LIMIT)
        flushed = []

        def between():
            if not flushed:  # garbage goes while waiting, off the critical path
                self.recycler.flush()
                flushed.append(True)
            # first, as it ticks this process's clock: a freeze that just ended is known
            # before the deadline is judged, whichever thread of this process runs first
            self._monitor.maybe_check(wait_on, self.seq, self.op)
            # time this process spent stopped (SIGSTOP, a VM pause) is nobody's delay:
            # the collective's own timeout restarts when it resumes
            self.deadline = max(self.deadline, self._monitor.resumed_at + self.timeout)

        with self._stats.phase("wait_s"):
            incoming = self.wait_for(
                lambda: self.open_object(name, max_bytes=limit, collective=self.seq),
                deadline=lambda: self.deadline, between=between,
                expired=lambda: self._timeout_error(wait_on, what))
        if incoming.header.kind == KIND_ERROR:
            with incoming:
                raise self._remote_error(incoming)
        return incoming

    def _timeout_error(self, wait_on, what: str) -> SyncTimeout:
        missing = list(wait_on)
        if self.gathering is not None:  # name every rank still missing, not just the first
            missing = [k for k in wait_on if k != self.rank and not object_exists(
                self.storage, self.key_of(self.gathering[k]))]
        return SyncTimeout(
            f"timed out after {self.timeout:g} s in {self.op} waiting for {what} "
            f"(ranks {missing})",
            rank=self.rank, collective=self.seq, path=self.storage.path_of(self.prefix),
            hint="are those ranks running with the same URL, and calling the same "
            "collectives in the same order? Each wait's timeout is connect's timeout= "
            "(init_process_group's for the torch backend)",
        )

    def _remote_error(self, incoming: Incoming):
        if incoming.header.payload_nbytes > RECORD_LIMIT:  # its whole payload is buffered
            return ShardCorrupt(
                f"error record of {incoming.header.payload_nbytes} bytes, more than the "
                f"{RECORD_LIMIT} an error record can have; refused unread",
                rank=self.rank, collective=self.seq, path=incoming.path,
                hint="something else writes under this URL: give each job its own "
                "URL, and set a secret (FERROSYNC_SECRET)")
        data = incoming.read_bytes()
        try:
            info = loads_bounded(data)
            cls = error_class(info.get("type", ""))
            message = relayed(info.get("message"))
        except (ValueError, UnicodeDecodeError, AttributeError):
            cls, message = PeerFailed, "(unreadable error record)"
        return cls(f"rank {incoming.header.rank} reports: {message}", rank=self.rank,
                   collective=self.seq, path=incoming.path,
                   hint="fix the cause named above and restart every rank")

    def mismatch(self, other: int, their_digest: bytes, my_digest: bytes,
                 path: str) -> LayoutMismatch:
        """The ``LayoutMismatch`` for rank ``other``'s foreign digest, naming the first
        difference when its layout record is readable."""
        mine = self._layouts.get(my_digest, {})
        theirs = None
        try:
            theirs = self.read_record(names.layout_record(their_digest, other))
        except ShardCorrupt:
            theirs = None
        return LayoutMismatch(
            describe_mismatch(mine, theirs, self.rank, other), rank=self.rank,
            collective=self.seq, path=path, hint=MISMATCH_HINT,
        )
