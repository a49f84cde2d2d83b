"""``GenerationObjects``: writing, awaiting and opening the objects of one generation.

One per ``FileSync``, used only by the thread inside its collective. It knows where
a generation's objects live (``<prefix>/<name>``, names from ``ferrosync.names``),
seals what this rank writes (header, checksum, MAC), waits for what peers write
(polling one exact name with back-off, checking the peers' liveness meanwhile, never
past the collective's deadline) and checks what it opens before anyone reads a byte
of payload: generation, collective, size, and error records, which become the typed
error the peer reported.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from .. import names
from ..errors import (
    LayoutMismatch,
    PeerFailed,
    ShardCorrupt,
    SyncTimeout,
    error_class,
    relay_text,
    relayed,
)
from ..storage import RECORD_LIMIT, Backoff, object_exists
from ..wire import (
    DTYPE_CODES,
    HEADER_SIZE,
    KIND_ERROR,
    MAC_SIZE,
    Header,
    decode_record,
    encode_record,
    loads_bounded,
    seal,
)
from .common import MISMATCH_HINT, describe_mismatch
from .incoming import Incoming, read_header
from .recycler import Recycler

_log = logging.getLogger(__name__)


class GenerationObjects:
    """The objects of generation ``generation`` below ``prefix`` on ``storage``.

    ``begin(op)`` starts collective ``seq`` and its deadline; every wait of that
    collective ends by it (restarted after the process was paused, see
    ``PeerMonitor.resumed_at``).
    """

    def __init__(self, storage, prefix: str, generation, *, rank: int, world_size: int,
                 key: bytes | None, poll: tuple[float, float], monitor, stats,
                 timeout: float, url: str) -> None:
        self.storage = storage
        self.prefix = prefix
        self.generation = generation
        self.rank, self.world_size = rank, world_size
        self.key = key
        self.timeout = timeout
        self.recycler = Recycler(storage, world_size)
        self._poll = poll
        self._monitor = monitor
        self._stats = stats
        self._url = url
        self._layouts: dict[bytes, dict] = {}
        self.seq = 0
        self.op = ""
        self.deadline = 0.0
        self.gathering: dict[int, str] | None = None  # names awaited in a gather
        # set by the owner: raises if nothing more may be published for collective ``op``
        # (the owning GradSync's rule, ``guard.OwnershipGuard._raise_if_failed``)
        self.before_put = lambda op: None

    # -- naming --------------------------------------------------------------------------------
    def key_of(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def path_of(self, name: str) -> str:
        return self.storage.path_of(self.key_of(name))

    # -- one collective ------------------------------------------------------------------------
    def begin(self, op: str) -> int:
        self.recycler.before_collective()
        self.seq += 1
        self.op = op
        self.deadline = time.monotonic() + self.timeout
        return self.seq

    # -- writing -------------------------------------------------------------------------------
    def put(self, name: str, header: Header, parts: list) -> None:
        """Seal and publish one collective object (atomically, see ``storage.put``)."""
        self.before_put(self.op)
        key = self.key_of(name)
        head = seal(header, parts, self.key)
        nbytes = len(head) + header.payload_nbytes
        self.storage.put(key, [head, *parts], reuse=self.recycler.take_spare(nbytes))
        # collective data objects only (not heartbeats or layout records): what a
        # collective costs in objects
        self.storage.counters.add(objects=1)
        self.recycler.written(key, nbytes)

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
        self.storage.put(self.key_of(names.layout_record(digest, self.rank)),
                         [encode_record(layout, self.key)])

    # -- waiting and opening -----------------------------------------------------------------
    def wait_open(self, name: str, wait_on, what: str, payload_nbytes: int) -> Incoming:
        """Block until object ``name`` exists and return it opened, header checked.

        Polls the exact name with back-off; while waiting, deletes garbage and checks
        the peers in ``wait_on`` (abort markers, heartbeats) once per interval. An
        error record raises the error its writer reported. ``payload_nbytes`` is the
        payload the layout expects: a larger object (or error record) is refused by
        its size, before a byte of its payload is read or buffered.
        """
        key = self.key_of(name)
        storage = self.storage
        limit = HEADER_SIZE + MAC_SIZE + max(payload_nbytes, RECORD_LIMIT)
        with self._stats.phase("wait_s"):
            reader = storage.open(key, max_bytes=limit, rank=self.rank)
            if reader is None:
                self.recycler.flush()
                backoff = Backoff(*self._poll)
                while (reader := storage.open(key, max_bytes=limit, rank=self.rank)) is None:
                    # first, as it ticks this process's clock: a freeze that just ended
                    # is known before the deadline is judged, whichever thread of this
                    # process runs first after it
                    self._monitor.maybe_check(wait_on, self.seq, self.op)
                    # time this process spent stopped (SIGSTOP, a VM pause) is nobody's
                    # delay: the collective's own timeout restarts when it resumes
                    self.deadline = max(self.deadline, self._monitor.resumed_at + self.timeout)
                    if time.monotonic() >= self.deadline:
                        raise self._timeout_error(wait_on, what)
                    backoff.sleep(self.deadline)
        path = storage.path_of(key)
        try:
            incoming = self._open_checked(reader, path)
        except BaseException:
            reader.close()
            raise
        return incoming

    def _open_checked(self, reader, path: str) -> Incoming:
        with self._stats.phase("read_s"):
            header, raw_head = read_header(reader, path, self.rank, self.key)
        if header.generation != self.generation.tag or header.collective != self.seq:
            raise ShardCorrupt(
                f"object belongs to generation tag {header.generation:016x} collective "
                f"{header.collective}, expected {self.generation.token} collective "
                f"{self.seq}", rank=self.rank, collective=self.seq, path=path,
                hint="something else writes under this URL: give each job its own URL",
            )
        expected = header.size + header.payload_nbytes
        if reader.size != expected:
            raise ShardCorrupt(
                f"object has {reader.size} bytes, its header says {expected}",
                rank=self.rank, collective=self.seq, path=path,
                hint="the object was truncated or appended to on storage",
            )
        incoming = Incoming(reader, header, raw_head, path, self.key, self.rank)
        if header.kind == KIND_ERROR:
            if header.payload_nbytes > RECORD_LIMIT:  # its whole payload is buffered
                raise ShardCorrupt(
                    f"error record of {header.payload_nbytes} bytes, more than the "
                    f"{RECORD_LIMIT} an error record can have; refused unread",
                    rank=self.rank, collective=self.seq, path=path,
                    hint="something else writes under this URL: give each job its own "
                    "URL, and set a secret (FERROSYNC_SECRET)")
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
        raw = self.storage.read(self.key_of(names.layout_record(their_digest, other)))
        if raw is not None:
            try:
                theirs = decode_record(raw, self.key, path=path)
            except ShardCorrupt:
                theirs = None
        return LayoutMismatch(
            describe_mismatch(mine, theirs, self.rank, other), rank=self.rank,
            collective=self.seq, path=path, hint=MISMATCH_HINT,
        )
