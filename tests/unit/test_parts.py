"""Objects larger than a part on an object store (ferrosync/storage/engines/parts.py), on
fsspec's in-process ``memory://`` store with small parts: written as part objects and
a manifest put last, read back whole through concurrent GETs, deleted with their parts,
refused when too large before a part is read, and seen by gc as parts or orphans.
"""

from __future__ import annotations

import os
import uuid

import pytest

from ferrosync.errors import ShardCorrupt
from ferrosync.ops.keys import JobKeys
from ferrosync.ops.scan import classify, scan
from ferrosync.storage import names
from ferrosync.storage.engines import open_storage
from ferrosync.storage.engines.parts import (
    MAGIC,
    MIN_PART,
    PartsReader,
    Transfer,
    ViewsBody,
    chunks,
    encode_manifest,
    parse_manifest,
)

pytestmark = pytest.mark.unit
PART = MIN_PART


@pytest.fixture
def store():
    storage = open_storage(f"memory://parts-{uuid.uuid4().hex[:8]}", transfer=dict(
        max_request_bytes=2 * PART, part_bytes=PART, concurrency=3))
    yield storage
    storage.close()


def _keys(storage) -> list[str]:
    return [k for k, _ in storage.list("")]


@pytest.mark.parametrize("size", [0, 1, PART, PART + 1, 3 * PART - 7, 5 * PART])
def test_any_size_reads_back_whole(store, size):
    data = os.urandom(size)
    # buffers split anywhere: a part spans them, none is joined whole
    cut = size // 3
    assert store.put("g/obj", [data[:cut], bytearray(data[cut:])]) == size
    assert store.read("g/obj", max_bytes=None) == data
    stored = dict(store.list(""))
    parted = size > PART
    assert len(stored) == (1 + -(-size // PART) if parted else 1)
    assert max(stored.values(), default=0) <= PART  # no object over a part
    assert store.read_head("g/obj", 100) == data[:100]
    store.delete(["g/obj"])
    assert _keys(store) == []


def test_each_part_and_get_is_a_counted_request(store):
    data = os.urandom(4 * PART + 5)  # 5 parts
    before = store.counters.snapshot()
    store.put("obj", [data])
    after_put = store.counters.snapshot()
    assert after_put["puts"] - before["puts"] == 6  # 5 parts and the manifest
    manifest = store.fs.cat_file(store.fs_path("obj"))
    assert after_put["bytes_written"] - before["bytes_written"] == len(data) + len(manifest)
    assert store.read("obj", max_bytes=None) == data
    after_read = store.counters.snapshot()
    assert after_read["gets"] - after_put["gets"] == 6  # the manifest and 5 parts
    assert after_read["bytes_read"] - after_put["bytes_read"] == len(data) + len(manifest)


def test_an_object_too_large_is_refused_before_a_part_is_read(store):
    store.put("big", [os.urandom(4 * PART)])
    gets = store.counters.gets
    with pytest.raises(ShardCorrupt, match="more than the 1000 bytes"):
        store.open("big", max_bytes=1000)
    assert store.counters.gets == gets + 1  # the manifest only


def test_a_second_create_loses_and_leaves_no_part(store):
    first = os.urandom(3 * PART)
    store.put("once", [first], exclusive=True)
    with pytest.raises(FileExistsError):
        store.put("once", [os.urandom(3 * PART)], exclusive=True)
    assert store.read("once", max_bytes=None) == first
    assert len(_keys(store)) == 1 + 3  # the winner's manifest and parts only


def test_a_create_whose_manifest_landed_already_is_recognised_as_ours(store):
    """The last step's reply lost and the create sent again: the manifest there is this
    write's (it names its token), so the create succeeded."""
    data = os.urandom(2 * PART + 1)
    real_create = store._put_one
    calls = []

    def lost_reply(key, body, exclusive):
        real_create(key, body, exclusive)
        if key == "again" and not calls:
            calls.append(key)
            real_create(key, body, exclusive)  # the resend: finds its own manifest

    store._put_one = lost_reply
    store.put("again", [data], exclusive=True)
    assert calls == ["again"]
    assert store.read("again", max_bytes=None) == data


def test_overwriting_an_object_drops_its_old_parts(store):
    store.put("obj", [os.urandom(3 * PART)])
    store.put("obj", [os.urandom(2 * PART + 3)])
    assert len(_keys(store)) == 1 + 3
    store.put("obj", [b"small now"])
    assert _keys(store) == ["obj"]
    assert store.read("obj") == b"small now"


def test_bytes_that_look_like_a_manifest_are_stored_as_data(store):
    store.put("odd", [MAGIC + b"\x05\x00\x00\x00hello"])
    assert store.read("odd") == MAGIC + b"\x05\x00\x00\x00hello"


@pytest.mark.parametrize("raw", [
    MAGIC + b"\x02\x00\x00\x00{}",
    encode_manifest("0" * 16, [5, 5])[:-1] + b" ",
    encode_manifest("nothex-nothex-no", [5]),
    MAGIC + b"\xff\xff\xff\x7f",
])
def test_a_planted_manifest_is_refused(store, raw):
    store.fs.pipe_file(store.fs_path("planted"), raw)
    with pytest.raises(ShardCorrupt):
        store.read("planted", max_bytes=None)


def test_a_manifest_names_only_its_own_parts():
    token = "0123456789abcdef"
    found = parse_manifest(encode_manifest(token, [3, 4]), path="p", rank=0)
    assert (found.token, found.sizes, found.size) == (token, (3, 4), 7)
    assert names.parse(names.part("c3.r1", token, 2)) == names.Name(
        "part", number=2, token=token, target="c3.r1")


def test_a_missing_part_is_a_clear_error(store):
    store.put("holes", [os.urandom(3 * PART)])
    part = next(k for k in _keys(store) if k.endswith(".p1"))
    store.fs.rm_file(store.fs_path(part))
    with pytest.raises(Exception, match="vanished while it was read"):
        store.read("holes", max_bytes=None)


def test_chunks_are_views_of_the_buffers():
    a, b = bytearray(b"abcde"), bytearray(b"fghij")
    got = [(off, [bytes(p) for p in pieces])
           for off, pieces in chunks([memoryview(a), memoryview(b)], 4)]
    assert got == [(0, [b"abcd"]), (4, [b"e", b"fgh"]), (8, [b"ij"])]
    a[0:1] = b"Z"
    first = next(chunks([memoryview(a)], 4))[1][0]
    assert bytes(first) == b"Zbcd"  # a view, not a copy


def test_a_reader_holds_at_most_its_window():
    from concurrent.futures import ThreadPoolExecutor

    fetched = []

    def fetch(i, view):
        fetched.append(i)
        view[:] = bytes([i]) * 10

    with ThreadPoolExecutor(2) as pool:
        reader = PartsReader([10] * 8, fetch, pool, 2)
        buf = bytearray(15)
        assert reader.readinto(buf) == 15
        assert bytes(buf) == b"\x00" * 10 + b"\x01" * 5
        # parts 0 and 1 read, at most 2 ahead: never the whole object
        assert len(fetched) <= 4
        rest = bytearray(100)
        assert reader.readinto(rest) == 65
        assert bytes(rest[:65]) == b"\x01" * 5 + b"".join(bytes([i]) * 10 for i in range(2, 8))
        reader.close()
    assert sorted(fetched) == list(range(8))


def test_a_reader_fetches_whole_parts_straight_into_a_buffer_with_room():
    from concurrent.futures import ThreadPoolExecutor

    targets = []

    def fetch(i, view):
        targets.append(view.obj)  # the buffer the bytes land in
        view[:] = bytes([i]) * view.nbytes

    with ThreadPoolExecutor(2) as pool:
        reader = PartsReader([10] * 5 + [3], fetch, pool, 2, first=b"\xff" * 10)
        buf = bytearray(48)
        assert reader.readinto(buf) == 48
        middle = b"".join(bytes([i]) * 10 for i in (1, 2, 3))
        assert bytes(buf) == b"\xff" * 10 + middle + b"\x04" * 8
        # parts 1-3 landed in the caller's buffer; 4 (cut by its end) and 5 did not
        assert [t is buf for t in targets] == [True, True, True, False, False]
        tail = bytearray(10)
        assert reader.readinto(tail) == 5 and tail[:5] == b"\x04\x04\x05\x05\x05"
        reader.close()


def test_gc_sees_live_parts_in_their_object_and_orphans_as_temps(store):
    gen = names.generation_dir(1, "0123456789abcdef")
    store.put(f"{gen}/c0.r0", [os.urandom(3 * PART)])
    orphan = f"{gen}/" + names.part("c0.r1", "fedcba9876543210", 0)
    store.fs.pipe_file(store.fs_path(orphan), b"x" * 10)
    assert classify(orphan, 10).kind == "part"
    found = scan(store, JobKeys())
    generation = found.generations[gen]
    assert [o.key for o in generation.temps] == [orphan]
    assert len(generation.parts) == 3
    assert [o.size for o in generation.objects] == [3 * PART]  # its payload's size


def test_transfer_part_never_exceeds_a_request():
    assert Transfer(max_request_bytes=PART, part_bytes=4 * PART).part == PART


def test_a_views_body_reads_and_seeks_across_its_pieces():
    body = ViewsBody([memoryview(b"abc"), memoryview(b""), memoryview(bytearray(b"defgh"))])
    assert body.read() == b"abcdefgh" and body.tell() == 8
    assert body.seek(0, os.SEEK_END) == 8 and body.seek(2) == 2
    assert body.read(3) == b"cde" and body.read(100) == b"fgh" and body.read() == b""
    body.seek(-1, os.SEEK_CUR)
    assert body.read() == b"h"


def test_checkpoints_in_parts_load_and_go_with_their_parts_in_a_later_run(store):
    """A checkpoint written in parts by one run loads whole, and a later run's prune,
    which never wrote or read it, removes its parts too."""
    import torch

    from ferrosync.train.checkpoint import Checkpoints

    def checkpoints():
        ckpt = Checkpoints(store.url)
        ckpt.storage.set_transfer(max_request_bytes=2 * PART, part_bytes=PART)
        return ckpt

    weights = torch.arange(3 * PART // 4, dtype=torch.float32)  # 3 parts and more
    first = checkpoints()
    first.save({"w": weights}, {"step": 1}, keep=1)
    assert torch.equal(first.load(first.latest())["w"], weights)
    assert sum(names.parse(k).kind == "part" for k in _keys(store)) == 4
    checkpoints().save({"w": weights[:10].clone()}, {"step": 2}, keep=1)  # a later run
    assert _keys(store) == ["latest.json", "step-00000002.pt"]
