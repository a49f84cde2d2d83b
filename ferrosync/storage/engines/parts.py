"""Objects larger than one request on an object store: part objects, then a manifest at
the final name (docs/design.md#large-objects, which says why not S3 multipart).

Nobody sees the object half-written, a create whose reply was lost is recognised by the
manifest's token (``Storage.exclusive_create``), and the payload's checksum or MAC covers all parts.
``PartsReader`` reads ``concurrency`` parts at a time, straight into the caller's
buffer where it has room: never a copy of the object.
"""

from __future__ import annotations

import bisect
import collections
import functools
import io
import itertools
import json
import re
import secrets
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from ferrosync.errors import ShardCorrupt
from ferrosync.storage.engines.base import Reader

#: what starts a manifest (no ferrosync object or record starts so: ``wire``'s magics)
MAGIC = b"FSYNCPRT"
_LENGTH = struct.Struct("<I")
#: bytes before a manifest's JSON body
PREFIX = len(MAGIC) + _LENGTH.size
#: the largest manifest: 5 TiB in 16 MiB parts is 330 k sizes of 9 digits
MANIFEST_LIMIT = 4 << 20
#: the smallest request limit and part size accepted (a manifest must fit in a request)
MIN_PART = 64 << 10
_TOKEN = re.compile(r"[0-9a-f]{16}")

#: S3's documented largest single PUT (5 GiB); also the default elsewhere (GCS and Azure
#: allow more in one request, so it is safe there)
S3_MAX_REQUEST = 5 << 30
#: a part (and a ranged GET): AWS's guidance is 8-16 MB per connection
DEFAULT_PART = 16 << 20
#: parts or ranges in flight per object. At S3's ~100 MB/s per connection, 16 fill a
#: 10 Gbit/s host (1.25 GB/s); measured behind a per-connection cap in docs/design.md
DEFAULT_CONCURRENCY = 16


@dataclass(frozen=True)
class Transfer:
    """How an object store moves one object: the largest request body, the part size
    (parts of a large write, ranges of a large read) and the parts in flight."""

    max_request_bytes: int = S3_MAX_REQUEST
    part_bytes: int = DEFAULT_PART
    concurrency: int = DEFAULT_CONCURRENCY

    @property
    def part(self) -> int:
        """The part size actually used: never larger than one request may be."""
        return min(self.part_bytes, self.max_request_bytes)

    def replace(self, *, max_request_bytes: int | None = None, part_bytes: int | None = None,
                concurrency: int | None = None) -> Transfer:
        """This transfer with the given settings (None: kept)."""
        return Transfer(
            self.max_request_bytes if max_request_bytes is None else max_request_bytes,
            self.part_bytes if part_bytes is None else part_bytes,
            self.concurrency if concurrency is None else concurrency)


def encode_manifest(token: str, sizes: Sequence[int]) -> bytes:
    """A manifest: ``MAGIC``, the body's length, then JSON ``{"v", "token", "size",
    "parts"}`` (the parts' sizes, in order)."""
    body = json.dumps({"v": 1, "token": token, "size": sum(sizes), "parts": list(sizes)},
                      separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(body)) + body


def manifest_length(head: bytes) -> int:
    """The whole manifest's length from its first ``PREFIX`` bytes (bounded)."""
    (n,) = _LENGTH.unpack_from(head, len(MAGIC))
    return PREFIX + n


@dataclass(frozen=True)
class Manifest:
    token: str
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return sum(self.sizes)


def parse_manifest(raw: bytes, *, path: str, rank: int | None) -> Manifest:
    """The manifest in ``raw`` (all of it), checked: a bad one is ``ShardCorrupt``."""
    def bad(why: str) -> ShardCorrupt:
        return ShardCorrupt(f"bad part manifest ({why})", rank=rank, path=path,
                            hint="remove it, and give every job a location only its own "
                            "ranks can write")

    if len(raw) < PREFIX or manifest_length(raw) != len(raw) or len(raw) > MANIFEST_LIMIT:
        raise bad("its length does not match")
    try:
        body = json.loads(raw[PREFIX:])
    except ValueError:
        raise bad("not JSON") from None
    if not isinstance(body, dict) or body.get("v") != 1:
        raise bad("unknown version")
    token, sizes, size = body.get("token"), body.get("parts"), body.get("size")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise bad("no write token")
    if not isinstance(sizes, list) or not sizes or not all(
            type(s) is int and s > 0 for s in sizes) or sum(sizes) != size:
        raise bad("its parts' sizes do not add up")
    return Manifest(token, tuple(sizes))


def listed_parts(listing, keys) -> list[str]:
    """The part objects in ``listing`` (``Storage.list``'s (key, size)) of the objects
    ``keys``: what to delete with objects this process did not write or read (a
    previous run's), which ``Storage.delete`` cannot know the parts of."""
    from ferrosync.storage import names

    doomed = set(keys)
    out = []
    for key, _ in listing:
        directory, _, name = key.rpartition("/")
        found = names.parse(name)
        if found.kind == "part" and names.within(directory, found.target) in doomed:
            out.append(key)
    return out


def new_token() -> str:
    """The token that makes one write's part names unique."""
    return secrets.token_hex(8)


def chunks(views: Sequence[memoryview], part: int):
    """``(offset, pieces)`` of consecutive ``part``-byte slices of the concatenation of
    ``views`` (the last shorter): each piece a view, never a copy."""
    pieces, filled, offset = [], 0, 0
    for view in views:
        pos = 0
        while pos < view.nbytes:
            n = min(part - filled, view.nbytes - pos)
            pieces.append(view[pos:pos + n])
            pos += n
            filled += n
            if filled == part:
                yield offset, pieces
                offset += filled
                pieces, filled = [], 0
    if filled:
        yield offset, pieces


def body_of(pieces: Sequence[memoryview]) -> bytes:
    """One request's body: the drivers take ``bytes`` (a copy of one part, at most)."""
    return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)


class ViewsBody(io.RawIOBase):
    """A request body read straight out of ``pieces`` (views of the caller's buffers):
    for a client that streams a file-like body (botocore, then aiohttp, 64 KiB at a
    time), so a part in flight costs no copy of its own, nor a socket buffer's."""

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        super().__init__()
        self._pieces = list(pieces)
        self._ends = list(itertools.accumulate(p.nbytes for p in self._pieces))
        self.size = self._ends[-1] if self._ends else 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = min(max(0, base + offset), self.size)
        return self._pos

    def readinto(self, buf) -> int:
        out = memoryview(buf).cast("B")
        filled = 0
        index = bisect.bisect_right(self._ends, self._pos)
        while filled < out.nbytes and index < len(self._pieces):
            start = self._pos - (self._ends[index] - self._pieces[index].nbytes)
            n = min(out.nbytes - filled, self._pieces[index].nbytes - start)
            out[filled:filled + n] = self._pieces[index][start:start + n]
            filled += n
            self._pos += n
            index += 1 if start + n == self._pieces[index].nbytes else 0
        return filled

    def close(self) -> None:
        self._pieces = []  # the caller's buffers are no longer held
        super().close()


def run_window(pool: ThreadPoolExecutor, jobs, width: int) -> None:
    """Run the callables ``jobs`` on ``pool``, at most ``width`` at a time (what each
    holds in memory is bounded so), and raise the first failure once all started
    ones ended."""
    running: collections.deque[Future] = collections.deque()
    error: BaseException | None = None
    for job in jobs:
        if error is not None:
            break
        if len(running) >= width:
            error = _outcome(running.popleft(), error)
        running.append(pool.submit(job))
    while running:
        error = _outcome(running.popleft(), error)
    if error is not None:
        raise error


def _outcome(future: Future, error: BaseException | None) -> BaseException | None:
    try:
        future.result()
    except BaseException as exc:  # noqa: BLE001 - the first is re-raised by run_window
        return error or exc
    return error


class PartsReader(Reader):
    """A sequential reader over ``segments`` fetched ``window`` at a time on ``pool``.

    ``fetch_into(i, view)`` fills ``view`` (exactly ``sizes[i]`` bytes) with segment
    ``i``'s bytes, or raises; a retry of it fills the same view again from its start.
    ``first``, if given, is segment 0's bytes, held already. A ``readinto`` whose buffer
    has room for whole segments not yet started has them fetched straight into it
    (``window`` at a time: no copy of the object); others are fetched ahead into
    buffers of their own, in order, and dropped once copied out."""

    def __init__(self, sizes: Sequence[int],
                 fetch_into: Callable[[int, memoryview], None],
                 pool: ThreadPoolExecutor, window: int, first: bytes | None = None) -> None:
        self.size = sum(sizes)
        self._sizes = sizes
        self._fetch_into = fetch_into
        self._pool = pool
        self._window = max(1, window)
        self._next = 0  # the next segment to start fetching
        self._ahead: collections.deque[tuple[int, Future]] = collections.deque()
        self._current = memoryview(b"")
        if first is not None:
            self._current = memoryview(first)
            self._next = 1

    def _fetch(self, index: int) -> bytearray:
        buf = bytearray(self._sizes[index])
        self._fetch_into(index, memoryview(buf))
        return buf

    def _top_up(self) -> None:
        while len(self._ahead) < self._window and self._next < len(self._sizes):
            self._ahead.append((self._sizes[self._next],
                                self._pool.submit(self._fetch, self._next)))
            self._next += 1

    def _direct(self, view: memoryview, pos: int) -> int:
        """Fetch the segments not yet started that fit whole in ``view`` from ``pos``
        (the end of what is held or fetched ahead) straight into it; where they end."""
        jobs = []
        while self._next < len(self._sizes) and pos + self._sizes[self._next] <= view.nbytes:
            size = self._sizes[self._next]
            jobs.append(functools.partial(self._fetch_into, self._next, view[pos:pos + size]))
            pos += size
            self._next += 1
        if jobs:
            run_window(self._pool, jobs, self._window)
        return pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        # first what is held and fetched ahead, then whole segments straight into view
        held = self._current.nbytes + sum(size for size, _ in self._ahead)
        if view.nbytes >= held:
            filled = self._direct(view, held)
            self._drain(view[:held], 0)
        else:
            filled = 0
        return self._drain(view, filled)

    def _drain(self, view: memoryview, filled: int) -> int:
        """Copy held and fetched-ahead segments into ``view`` from ``filled``."""
        while filled < view.nbytes:
            if not self._current.nbytes:
                self._top_up()
                if not self._ahead:
                    break
                self._current = memoryview(self._ahead.popleft()[1].result())
                self._top_up()
            n = min(view.nbytes - filled, self._current.nbytes)
            view[filled:filled + n] = self._current[:n]
            self._current = self._current[n:]
            filled += n
        return filled

    def close(self) -> None:
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        self._current = memoryview(b"")
        self._next = len(self._sizes)
