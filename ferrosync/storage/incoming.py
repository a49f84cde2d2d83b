"""What one object of a collective must say about itself, and reading one that arrived.

``Expected`` is built once per object a rank writes or waits for; it makes the header
the writer puts on the object and checks every field of the header a reader finds,
so the two sides cannot drift apart. ``Incoming`` is an opened object whose header
passed ``GenerationObjects.wait_open``'s checks: its payload is read (verified as it
streams) into the caller's tensors.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ferrosync.compression.codecs import Codec, as_uint8
from ferrosync.errors import ShardCorrupt
from ferrosync.storage.wire import (
    DTYPE_CODES,
    FLAG_AUTH,
    FLAG_EMPTY,
    FLAG_UNCHANGED,
    HEADER_SIZE,
    KIND_NAMES,
    Header,
    PayloadCheck,
    head_size,
    parse_header,
)


def read_header(reader, path: str, rank: int, key: bytes | None) -> tuple[Header, bytes]:
    """The checked header at the start of an opened object, and its raw bytes (with the
    MAC, if any: the payload check covers them)."""
    raw = bytearray(head_size(True))
    got = reader.readinto(memoryview(raw)[:HEADER_SIZE])
    header = parse_header(raw[:got], path=path, rank=rank, key=key)
    if header.flags & FLAG_AUTH:
        reader.readinto(memoryview(raw)[HEADER_SIZE:])
    return header, bytes(raw[:header.size])


@dataclass(frozen=True)
class Part:
    """Which elements of a flat vector an object carries: ``count`` elements from
    ``offset`` of a ``total``-element vector, slice ``index`` of ``of``."""

    offset: int
    count: int
    total: int
    index: int = 0
    of: int = 1

    @classmethod
    def whole(cls, n: int) -> Part:
        return cls(0, n, n)


@dataclass(frozen=True)
class Expected:
    """Every header field of one object of collective ``seq``, except the writer's
    weight, flags and payload size (which only the writer knows)."""

    kind: int
    dtype: torch.dtype
    codec: Codec
    digest: bytes
    part: Part
    world_size: int
    generation: int  # the generation tag
    seq: int

    @property
    def block(self) -> int:
        return self.codec.block

    def header(self, writer: int, *, weight: float, nbytes: int, flags: int = 0) -> Header:
        """The header ``writer`` puts on this object."""
        part = self.part
        return Header(
            kind=self.kind, dtype=DTYPE_CODES[self.dtype], codec=self.codec.code, rank=writer,
            world_size=self.world_size, generation=self.generation, collective=self.seq,
            count=part.count, offset=part.offset, total=part.total, weight=weight,
            layout=self.digest, payload_nbytes=nbytes, flags=flags, slice=part.index,
            nslices=part.of, block=self.block,
        )

    def check(self, header: Header, src: int, path: str, rank: int, mismatch) -> None:
        """Compare every field of ``header`` with this expectation (raises ``ShardCorrupt``).

        The generation token and collective number were checked when the object was
        opened; here the writer's rank (an object copied onto another rank's name is a
        replay), kind, layout, encoding, size and slice. With a secret the header is
        authenticated, so a forger cannot edit these fields, only move whole objects.
        ``mismatch(src, their_digest)`` builds the ``LayoutMismatch`` for a foreign digest.
        """
        def corrupt(what: str, hint: str | None = None) -> ShardCorrupt:
            return ShardCorrupt(what, rank=rank, collective=self.seq, path=path, hint=hint)

        if header.rank != src:
            raise corrupt(
                f"object was written by rank {header.rank} but lies under rank {src}'s name "
                "(a copied or replayed object)",
                "something else writes under this URL: give each job its own URL, "
                "and set a secret if the storage is shared with others")
        if header.kind != self.kind:
            raise corrupt(
                f"expected a {KIND_NAMES[self.kind]} object, found a "
                f"{KIND_NAMES[header.kind]}",
                "ranks called different collectives: keep the collective order identical")
        if header.layout != self.digest:
            raise mismatch(src, header.layout)
        part = self.part
        expect = (DTYPE_CODES[self.dtype], self.codec.code, self.block, part.count,
                  part.offset, part.total, part.index, part.of, self.world_size)
        got = (header.dtype, header.codec, header.block, header.count, header.offset,
               header.total, header.slice, header.nslices, header.world_size)
        if got != expect:
            raise corrupt(
                "header fields (dtype, codec, block, count, offset, total, slice, nslices, "
                f"world) = {got}, expected {expect}",
                "ranks must use the same options (wire_dtype, topk_density, topk_bits, reduce) "
                "and ferrosync version")
        if not math.isfinite(header.weight) or header.weight < 0:
            raise corrupt(f"invalid weight {header.weight} from rank {header.rank}")
        if header.flags & FLAG_EMPTY and header.payload_nbytes:
            raise corrupt("an empty contribution carries a payload")
        if not header.flags & (FLAG_EMPTY | FLAG_UNCHANGED) and (
            header.payload_nbytes != self.codec.nbytes(part.count)
        ):
            raise corrupt(f"payload has {header.payload_nbytes} bytes, {part.count} elements "
                          f"need {self.codec.nbytes(part.count)}")


@dataclass
class Incoming:
    """An opened object: its reader, parsed header, raw header bytes (the MAC covers
    them) and path. Close it (``with incoming:``) once read."""

    reader: object
    header: Header
    raw_head: bytes
    path: str
    key: bytes | None  # the job's secret, for the payload MAC
    rank: int  # the reading rank, for error messages

    def __enter__(self) -> Incoming:
        return self

    def __exit__(self, *exc) -> None:
        self.reader.close()

    def _check(self) -> PayloadCheck:
        return PayloadCheck(self.header, self.raw_head, self.key, self.path, self.rank)

    def read_bytes(self) -> bytes:
        """The whole payload, verified."""
        buf = bytearray(self.header.payload_nbytes)
        check = self._check()
        got = self.reader.readinto(buf)
        check.update(memoryview(buf)[:got])
        check.finish()
        return bytes(buf)

    def read_into_buffers(self, buffers) -> None:
        """The whole payload, read straight into ``buffers`` in order (writable byte
        buffers whose sizes add up to the payload's), and verified: ``ShardCorrupt``
        after the last one if it is truncated or its checksum or MAC fails, so the
        caller must not use the buffers before this returns."""
        check = self._check()
        for buf in buffers:
            view = memoryview(buf).cast("B")
            got = self.reader.readinto(view)
            check.update(view[:got])
            if got < len(view):
                break
        check.finish()

    def chunks(self, codec: Codec, device: torch.device, chunk_bytes: int, pool, stats):
        """Yield ``(values, start, end)`` decoded chunk by chunk onto ``device``.

        The payload is verified as it streams; ``ShardCorrupt`` is raised at the end
        (after the last chunk) if its checksum or MAC fails, so a consumer must not
        publish anything derived from the chunks before the generator is exhausted.
        """
        header = self.header
        check = self._check()
        total = header.payload_nbytes
        step = codec.chunk_frames(chunk_bytes) * codec.frame_bytes
        buf = pool.get("read", min(step, total), torch.uint8, "cpu",
                       pinned=device.type == "cuda")
        done = elem = 0
        while done < total:
            size = min(step, total - done)
            view = buf[:size]
            host = view.numpy()
            t0 = time.perf_counter()
            got = self.reader.readinto(host)
            t1 = time.perf_counter()
            stats.add_time("read_s", t1 - t0)
            check.update(host[:got])
            if got < size:
                check.finish()  # raises: truncated
            n = min(size // codec.frame_bytes * codec.frame_elems, header.count - elem)
            chunk = view if device.type == "cpu" else view.to(device, non_blocking=False)
            yield codec.decode(chunk, n), elem, elem + n
            stats.add_time("reduce_s", time.perf_counter() - t1)
            elem += n
            done += size
        check.finish()

    def read_into(self, out: torch.Tensor, codec: Codec, chunk_bytes: int, pool,
                  stats) -> None:
        """Read a result payload into ``out`` (verified before returning)."""
        if codec.raw and out.device.type == "cpu" and out.dtype == codec.wire_dtype:
            # zero-copy: the payload lands straight in the caller's memory
            check = self._check()
            host = as_uint8(out).numpy()
            with stats.phase("read_s"):
                got = self.reader.readinto(host)
                check.update(host[:got])
            check.finish()
            return
        for values, lo, hi in self.chunks(codec, out.device, chunk_bytes, pool, stats):
            out[lo:hi].copy_(values)
