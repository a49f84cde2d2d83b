"""``storage/incoming.py`` in one process: the header an object must carry, and
reading a payload that is verified as it streams.

``Expected`` builds the writer's header and checks the reader's, so each field is
tampered with here one at a time and must be refused with the error that names it.
``Incoming`` objects are sealed with ``wire.seal`` and read from a ``BytesReader``
(tests/fakes.py); a damaged payload must raise ``ShardCorrupt`` and never pass as data.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ferrosync.compression.codecs import Int8Codec, RawCodec
from ferrosync.core.flat import BufferPool
from ferrosync.core.stats import StatsBook
from ferrosync.errors import LayoutMismatch, ShardCorrupt
from ferrosync.storage.engines import Counters
from ferrosync.storage.engines.base import BytesReader
from ferrosync.storage.incoming import Expected, Incoming, Part
from ferrosync.storage.wire import (
    FLAG_EMPTY,
    FLAG_UNCHANGED,
    KIND_CONTRIB,
    KIND_RESULT,
    layout_digest,
    parse_header,
    seal,
)

pytestmark = pytest.mark.unit

DIGEST = layout_digest("float32[1000]")
TAG = 0x0123456789ABCDEF
SEQ = 7
N = 1000
KEY = b"s" * 32


def expectation(codec=None, part=None, kind=KIND_CONTRIB, world=4) -> Expected:
    return Expected(kind, torch.float32, codec or RawCodec(torch.float32), DIGEST,
                    part or Part.whole(N), world, TAG, SEQ)


def refuse_mismatch(src, their_digest):
    return LayoutMismatch(f"rank {src} sent digest {their_digest.hex()}")


# -- Expected: the writer's header passes, every tampered field is refused ------------------

@pytest.mark.parametrize("codec,part", [
    (RawCodec(torch.float32), Part.whole(N)),
    (Int8Codec(), Part.whole(N)),
    (RawCodec(torch.float32), Part(250, 250, N, index=1, of=4)),
], ids=["raw", "int8", "slice"])
def test_the_writers_header_passes_the_readers_check(codec, part):
    expected = expectation(codec, part)
    header = expected.header(2, weight=0.5, nbytes=codec.nbytes(part.count))
    expected.check(header, 2, "mem://x", 0, refuse_mismatch)
    assert header.block == (codec.frame_elems if isinstance(codec, Int8Codec) else 0)


@pytest.mark.parametrize("flags", [FLAG_EMPTY, FLAG_UNCHANGED])
def test_an_object_without_payload_passes_when_flagged(flags):
    expected = expectation()
    expected.check(expected.header(1, weight=0.0, nbytes=0, flags=flags), 1, "p", 0,
                   refuse_mismatch)


TAMPERED = {
    "replayed": (dict(rank=3), "written by rank 3 but lies under rank 1's name"),
    "kind": (dict(kind=KIND_RESULT), "expected a contribution object, found a result"),
    "dtype": (dict(dtype=99), "header fields"),
    "codec": (dict(codec=Int8Codec.code), "header fields"),
    "block": (dict(block=256), "header fields"),
    "count": (dict(count=N - 1), "header fields"),
    "offset": (dict(offset=1), "header fields"),
    "total": (dict(total=N + 1), "header fields"),
    "slice": (dict(slice=1), "header fields"),
    "nslices": (dict(nslices=2), "header fields"),
    "world": (dict(world_size=5), "header fields"),
    "negative-weight": (dict(weight=-1.0), "invalid weight -1.0"),
    "nan-weight": (dict(weight=math.nan), "invalid weight nan"),
    "inf-weight": (dict(weight=math.inf), "invalid weight inf"),
    "empty-with-payload": (dict(flags=FLAG_EMPTY), "an empty contribution carries a payload"),
    "payload-size": (dict(payload_nbytes=4 * N + 4), f"payload has {4 * N + 4} bytes"),
}


@pytest.mark.parametrize("name", list(TAMPERED))
def test_every_tampered_field_is_refused_by_name(name):
    change, needle = TAMPERED[name]
    expected = expectation()
    header = dataclasses.replace(expected.header(1, weight=1.0, nbytes=4 * N), **change)
    with pytest.raises(ShardCorrupt) as info:
        expected.check(header, 1, "mem://g/c7.r1", 0, refuse_mismatch)
    assert needle in str(info.value)
    assert info.value.collective == SEQ and info.value.path == "mem://g/c7.r1"


def test_a_foreign_layout_is_a_layout_mismatch_not_corruption():
    expected = expectation()
    foreign = layout_digest("float32[999]")
    header = dataclasses.replace(expected.header(1, weight=1.0, nbytes=4 * N), layout=foreign)
    with pytest.raises(LayoutMismatch, match=f"rank 1 sent digest {foreign.hex()}"):
        expected.check(header, 1, "p", 0, refuse_mismatch)


# -- Incoming: verified as it streams ------------------------------------------------------

def sealed(values: torch.Tensor, codec, *, key=None, damage=None) -> Incoming:
    """An opened object carrying ``values`` encoded with ``codec`` (optionally damaged
    at payload byte ``damage``), header already read, as ``wait_open`` hands it over."""
    n = values.numel()
    payload = torch.empty(codec.nbytes(n), dtype=torch.uint8)
    codec.encode(values, payload)
    body = payload.numpy().tobytes()
    header = expectation(codec, Part.whole(n)).header(1, weight=1.0, nbytes=len(body))
    head = seal(header, [body], key)
    data = bytearray(head + body)
    if damage is not None:
        data[len(head) + damage] ^= 0x01
    reader = BytesReader(bytes(data))
    raw = bytearray(len(head))
    reader.readinto(raw)
    parsed = parse_header(raw, path="mem://x", rank=0, key=key)
    return Incoming(reader, parsed, bytes(raw[: parsed.size]), "mem://x", key, 0)


def stats():
    return StatsBook(Counters())


@pytest.mark.parametrize("key", [None, KEY], ids=["checksum", "mac"])
def test_a_clean_payload_reads_back_exactly(key):
    values = torch.linspace(-1, 1, N)
    out = torch.empty(N)
    sealed(values, RawCodec(torch.float32), key=key).read_into(
        out, RawCodec(torch.float32), 1 << 20, BufferPool(), stats())
    assert torch.equal(out, values)


@pytest.mark.parametrize("key,what", [(None, "checksum"), (KEY, "MAC")])
def test_one_flipped_payload_bit_is_refused(key, what):
    incoming = sealed(torch.ones(N), RawCodec(torch.float32), key=key, damage=123)
    with pytest.raises(ShardCorrupt, match=f"payload {what} mismatch"):
        incoming.read_into(torch.empty(N), RawCodec(torch.float32), 1 << 20, BufferPool(),
                           stats())


def test_a_truncated_payload_is_refused():
    incoming = sealed(torch.ones(N), RawCodec(torch.float32))
    incoming.reader.size -= 8
    incoming.reader._data = incoming.reader._data[:-8]
    with pytest.raises(ShardCorrupt, match=f"payload is truncated: {4 * N - 8} of {4 * N}"):
        incoming.read_bytes()


@pytest.mark.parametrize("codec", [RawCodec(torch.float32), Int8Codec()], ids=["raw", "int8"])
def test_chunks_decode_the_whole_payload_in_frame_aligned_pieces(codec):
    values = torch.linspace(-3, 3, N)
    # a chunk lives in a reused read buffer: valid until the next one is read
    pieces = [(v.float().clone(), lo, hi) for v, lo, hi in sealed(values, codec).chunks(
        codec, torch.device("cpu"), 1024, BufferPool(), stats())]
    assert len(pieces) > 1 and pieces[0][1] == 0 and pieces[-1][2] == N
    assert all(hi - lo == v.numel() for v, lo, hi in pieces)
    got = torch.cat([v for v, _, _ in pieces])
    bound = 0 if codec.raw else 3 / 127  # int8: absmax/127 per frame
    assert (got - values).abs().max().item() <= bound + 1e-6


def test_a_damaged_chunked_payload_fails_after_the_last_chunk_before_use():
    """A consumer must not publish what it derived from chunks before the generator is
    exhausted: the damage (in the first chunk) is only known at the end."""
    codec = RawCodec(torch.float32)
    seen = []
    with pytest.raises(ShardCorrupt, match="payload checksum mismatch"):
        for _values, lo, hi in sealed(torch.ones(N), codec, damage=0).chunks(
                codec, torch.device("cpu"), 1024, BufferPool(), stats()):
            seen.append((lo, hi))
    assert seen[-1][1] == N and len(seen) == -(-4 * N // 1024)
