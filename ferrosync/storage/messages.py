"""Point-to-point messages of one generation through storage (``Mailbox``).

A message is one object with a collective object's header, numbered per (src, dst, tag)
and taking no collective number; a send never waits, a receive polls the exact name and
the sender's liveness and deletes what it read (docs/design.md#point-to-point). Used by
one ``StorageSync`` from the thread inside its call; not thread-safe.
"""

from __future__ import annotations

import json
import time

import torch

from ferrosync.compression.codecs import RawCodec, as_uint8
from ferrosync.errors import LayoutMismatch, PeerFailed, ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage.engines import RECORD_LIMIT
from ferrosync.storage.incoming import Expected, Part
from ferrosync.storage.objects import Objects
from ferrosync.storage.wire import DTYPE_CODES, DTYPES, KIND_BROADCAST, head_size, layout_digest


def message_digest(src: int, dst: int, tag: int) -> bytes:
    """The layout digest a message between ``src`` and ``dst`` with ``tag`` carries."""
    return layout_digest(json.dumps({"op": "message", "src": src, "dst": dst, "tag": tag}))


class Mailbox:
    """Send and receive point-to-point messages in one generation (see the module),
    through the generation's object layer (``objects``: sealing, bounded verified
    reads, exact-name waits and counters, as every collective object)."""

    def __init__(self, objects, *, world_size: int, monitor, stats, timeout: float,
                 pool, chunk_bytes: int) -> None:
        self.objects = objects
        self.rank, self.world_size = objects.rank, world_size
        self.timeout = timeout
        self._monitor = monitor
        self._stats = stats
        self._pool = pool
        self._chunk_bytes = chunk_bytes
        self._sent: dict[tuple[int, int], int] = {}  # (dst, tag) -> next number
        self._posted: dict[tuple[int, int], int] = {}  # (src, tag) -> next number

    def _expected(self, src: int, dst: int, tag: int, number: int, flat: torch.Tensor):
        return Expected(KIND_BROADCAST, flat.dtype, RawCodec(flat.dtype),
                        message_digest(src, dst, tag), Part.whole(flat.numel()),
                        self.world_size, self.objects.tag, number)

    # -- sending -----------------------------------------------------------------------------
    def send(self, flat: torch.Tensor, dst: int, tag: int) -> int:
        """Publish ``flat`` (contiguous) as the next message to ``dst`` on ``tag``; returns
        its number. Returns once the object is written: it never waits for ``dst``."""
        number = self._sent.get((dst, tag), 0)
        expected = self._expected(self.rank, dst, tag, number, flat)
        payload = as_uint8(flat).numpy() if flat.numel() else b""
        header = expected.header(self.rank, weight=1.0, nbytes=len(payload))
        with self._stats.phase("write_s"):
            # a message is written once under its own name (no recycled spare: its
            # reader, not the writer, consumes it)
            Objects.put(self.objects, names.message(self.rank, dst, tag, number), header,
                        [payload])
        self._sent[(dst, tag)] = number + 1
        return number

    # -- receiving ---------------------------------------------------------------------------
    def post(self, src: int, tag: int) -> int:
        """Take the number of the next message from ``src`` on ``tag`` (a receive posted
        now gets that message, whenever it is read)."""
        number = self._posted.get((src, tag), 0)
        self._posted[(src, tag)] = number + 1
        return number

    def receive(self, flat: torch.Tensor, src: int | None, tag: int,
                number: int | None = None, *, block: bool = True) -> int | None:
        """Read a message into ``flat`` (contiguous): message ``number`` of ``src`` (posted
        with ``post``), the next one of ``src``, or with ``src=None`` the next one of
        whichever rank has one first (see the module docstring). Returns the source
        rank, or None when ``block`` is False and nothing is there yet."""
        if src is not None and number is None:
            number = self.post(src, tag)
        candidates = [src] if src is not None else [
            r for r in range(self.world_size) if r != self.rank]
        deadline = [time.monotonic() + self.timeout]

        def between():
            try:
                self._monitor.maybe_check(candidates, None, None)
            except PeerFailed:
                found = self._look(flat, src, tag, number)  # sent, then closed
                if found is None:
                    raise
                return found
            # time this process spent stopped is nobody's delay (as in a collective)
            deadline[0] = max(deadline[0], self._monitor.resumed_at + self.timeout)
            return None

        with self._stats.phase("wait_s"):
            found = self._look(flat, src, tag, number)
            if found is None and block:
                found = self.objects.wait_for(
                    lambda: self._look(flat, src, tag, number), deadline=lambda: deadline[0],
                    between=between, expired=lambda: self._timeout(src, tag, number))
        if found is None:
            return None
        source, incoming, number = found
        self._read(incoming, flat, source, tag, number)
        if src is None:
            self._posted[(source, tag)] = number + 1
        return source

    def _look(self, flat, src, tag, number):
        """One poll: (source, opened object, number) of the message wanted, or None."""
        limit = head_size(True) + max(flat.numel() * flat.element_size(), RECORD_LIMIT)
        sources = [src] if src is not None else [
            r for r in range(self.world_size) if r != self.rank]
        for source in sources:
            n = number if src is not None else self._posted.get((source, tag), 0)
            # the header is checked there: magic, crc, MAC mode, this generation's tag,
            # the message number (in the collective field) and the object's size
            incoming = self.objects.open_object(names.message(source, self.rank, tag, n),
                                                max_bytes=limit, collective=n)
            if incoming is not None:
                return source, incoming, n
        return None

    def _read(self, incoming, flat: torch.Tensor, src: int, tag: int, number: int) -> None:
        name = names.message(src, self.rank, tag, number)
        path, header = incoming.path, incoming.header
        with incoming:
            what = f"message {number} from rank {src} (tag {tag})"
            if (header.dtype, header.count) != (DTYPE_CODES[flat.dtype], flat.numel()):
                theirs = DTYPES.get(header.dtype, f"dtype code {header.dtype}")
                raise LayoutMismatch(
                    f"rank {src} sent {header.count} elements of {theirs} as {what}; this "
                    f"rank receives {flat.numel()} of {flat.dtype}", rank=self.rank,
                    path=path, hint="send and receive tensors of the same dtype and size, "
                    "in the same order on both sides")
            expected = self._expected(src, self.rank, tag, number, flat)
            expected.check(header, src, path, self.rank, lambda other, digest: ShardCorrupt(
                f"{what} carries another pair's or tag's digest (a moved object)",
                rank=self.rank, path=path, hint="something else writes under this URL"))
            incoming.read_into(flat, expected.codec, self._chunk_bytes, self._pool,
                               self._stats)
        self.objects.storage.delete([self.objects.key_of(name)])  # read by its one reader

    def _timeout(self, src, tag, number) -> SyncTimeout:
        which = (f"message {number} from rank {src}" if src is not None
                 else "a message from any rank")
        return SyncTimeout(
            f"timed out after {self.timeout:g} s in recv waiting for {which} (tag {tag})",
            rank=self.rank, path=self.objects.storage.path_of(self.objects.prefix),
            hint="does the sending rank call send with this rank and tag, as many times?")

