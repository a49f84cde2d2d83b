"""The stored object format, pinned byte for byte, and the checks that guard it."""

from __future__ import annotations

import pickle

import pytest
import torch

from ferrosync.errors import ShardCorrupt
from ferrosync.storage.wire import (
    DTYPE_CODES,
    FLAG_AUTH,
    HEADER_SIZE,
    KIND_CONTRIB,
    MAC_SIZE,
    Header,
    PayloadCheck,
    decode_record,
    encode_record,
    parse_header,
    seal,
)

pytestmark = pytest.mark.unit

# A contribution of rank 1 (of 2), generation tag 0x0123456789abcdef, collective 7:
# three float32 values [1, -2, 0.5] with weight 2.5 and layout digest 00..07.
GOLDEN = bytes.fromhex(
    "4653594e01000000010100010100000002000000000000000100000000000000"
    "efcdab89674523010700000000000000030000000000000000000000000000000"
    "300000000000000000000000000044000010203040506070c00000000000000a2"
    "6289f6e5f709a440e135b1000000000000803f000000c00000003f"
)
# The same, authenticated with the key b"key" (HMAC-SHA256 after the header).
GOLDEN_MAC = bytes.fromhex(
    "4653594e01000100010100020100000002000000000000000100000000000000"
    "efcdab89674523010700000000000000030000000000000000000000000000000"
    "300000000000000000000000000044000010203040506070c0000000000000000"
    "000000000000000b0f7b7200000000770ad60f34c983ff59e35e7ffa1233842d"
    "f3211cd8b66725dd2f47584804684f0000803f000000c00000003f"
)
PAYLOAD = torch.tensor([1.0, -2.0, 0.5]).numpy().tobytes()


def golden_header() -> Header:
    return Header(kind=KIND_CONTRIB, dtype=DTYPE_CODES[torch.float32], codec=0, rank=1,
                  world_size=2, generation=0x0123456789ABCDEF, collective=7, count=3, offset=0,
                  total=3, weight=2.5, layout=bytes(range(8)), payload_nbytes=12)


def verify(blob: bytes, key: bytes | None) -> Header:
    header = parse_header(blob, path="mem://x", key=key)
    check = PayloadCheck(header, blob[: header.size], key, "mem://x", None)
    check.update(blob[header.size:])
    check.finish()
    return header


def test_golden_bytes():
    assert seal(golden_header(), [PAYLOAD], None) + PAYLOAD == GOLDEN
    assert seal(golden_header(), [PAYLOAD], b"key") + PAYLOAD == GOLDEN_MAC
    assert HEADER_SIZE == 112 and MAC_SIZE == 32


def test_golden_bytes_decode():
    header = verify(GOLDEN, None)
    assert (header.rank, header.collective, header.count, header.weight) == (1, 7, 3, 2.5)
    assert header.generation == 0x0123456789ABCDEF and header.layout == bytes(range(8))
    header = verify(GOLDEN_MAC, b"key")
    assert header.flags & FLAG_AUTH


@pytest.mark.parametrize("offset", range(0, len(GOLDEN)))
def test_every_single_bit_flip_is_caught(offset):
    blob = bytearray(GOLDEN)
    blob[offset] ^= 0x04
    with pytest.raises(ShardCorrupt):
        verify(bytes(blob), None)


@pytest.mark.parametrize("cut", [0, 4, 50, HEADER_SIZE, HEADER_SIZE + 5])
def test_truncation_is_caught(cut):
    with pytest.raises(ShardCorrupt):
        verify(GOLDEN[:cut], None)


def test_mac_rejects_wrong_key_missing_mac_and_unexpected_mac():
    with pytest.raises(ShardCorrupt, match="MAC mismatch"):
        verify(GOLDEN_MAC, b"other key")
    with pytest.raises(ShardCorrupt, match="carries no MAC"):
        verify(GOLDEN, b"key")
    with pytest.raises(ShardCorrupt, match="no secret"):
        verify(GOLDEN_MAC, None)


def test_forged_object_from_someone_without_the_key():
    # an attacker recomputes a valid xxh3 checksum over their own payload, with or
    # without a forged "authenticated" flag: the MAC check still refuses it
    evil = pickle.dumps(__import__("os").system)  # would run code if unpickled
    header = Header(kind=KIND_CONTRIB, dtype=DTYPE_CODES[torch.uint8], codec=0, rank=1,
                    world_size=2, generation=1, collective=1, count=len(evil), offset=0,
                    total=len(evil), weight=1.0, layout=b"\0" * 8, payload_nbytes=len(evil))
    forged = seal(header, [evil], b"attacker's guess") + evil
    with pytest.raises(ShardCorrupt):
        verify(forged, b"the real secret")
    plain = seal(header, [evil], None) + evil
    with pytest.raises(ShardCorrupt):
        verify(plain, b"the real secret")


def test_pickle_bytes_are_not_an_object():
    with pytest.raises(ShardCorrupt, match="not a ferrosync object"):
        parse_header(pickle.dumps({"x": 1}) + b"\0" * HEADER_SIZE, path="p")


def test_records_roundtrip_and_authenticate():
    record = {"a": 1, "b": [1, 2]}
    assert decode_record(encode_record(record, None), None, path="p") == record
    signed = encode_record(record, b"k")
    assert decode_record(signed, b"k", path="p") == record
    with pytest.raises(ShardCorrupt):
        decode_record(signed, b"other", path="p")
    with pytest.raises(ShardCorrupt):
        decode_record(encode_record(record, None), b"k", path="p")
    with pytest.raises(ShardCorrupt):
        decode_record(pickle.dumps(record), None, path="p")
    tampered = signed.replace(b'\\"a\\":1', b'\\"a\\":2')
    with pytest.raises(ShardCorrupt):
        decode_record(tampered, b"k", path="p")


def test_open_record_says_how_far_a_record_can_be_trusted():
    """One set of checks for both modes: decode_record refuses what is not trusted,
    the operator tools show everything with its trust."""
    import json

    from ferrosync.storage.wire import open_record

    record = {"beat": 3}
    plain, signed = encode_record(record, None), encode_record(record, b"k")
    cases = [
        (plain, None, "plain", record),
        (signed, b"k", "verified", record),
        (plain, b"k", "unsigned", None),  # the MAC is checked before the body is parsed
        (signed, None, "unverifiable", record),
        (signed, b"other", "forged", None),
        (b"not json", None, "malformed", None),
        (json.dumps({"v": 2, "body": "{}"}).encode(), None, "malformed", None),  # version
        (b" " * (1 << 20) + plain, None, "malformed", None),  # too large to be ours
        (json.dumps({"v": 1, "body": 5}).encode(), b"k", "malformed", None),
        (json.dumps({"v": 1, "body": "[1]"}).encode(), None, "plain", None),  # not an object
    ]
    for raw, key, auth, body in cases:
        opened = open_record(raw, key)
        assert (opened.auth, opened.body) == (auth, body), raw[:40]
        assert opened.trusted == (auth in ("plain", "verified") and body is not None)
        if opened.trusted:
            assert decode_record(raw, key, path="p") == body
        else:
            with pytest.raises(ShardCorrupt, match="unreadable control record"):
                decode_record(raw, key, path="p")
