"""``storage/objects.py`` in one process: sealing, waiting for and opening objects.

Two ``GenerationObjects`` (rank 0 and its peer) share one ``MemoryStorage`` and a
``FakeClock`` (tests/fakes.py); the peer's monitor is the real ``PeerMonitor`` on that
clock. What a peer does "later" is an action the clock runs inside rank 0's wait, so
every wait, timeout and freeze here is deterministic and takes milliseconds. The
header fields an object must carry are ``Expected``'s (tests/test_incoming.py).
"""

from __future__ import annotations

import pytest
import torch

from fakes import FakeClock, MemoryStorage
from ferrosync.compression.codecs import RawCodec
from ferrosync.core.stats import StatsBook
from ferrosync.errors import LayoutMismatch, PeerFailed, ShardCorrupt, SyncClosed, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage import objects as objects_module
from ferrosync.storage.incoming import Expected, Part
from ferrosync.storage.liveness import PeerMonitor, ProcessClock, publish_abort
from ferrosync.storage.objects import GenerationObjects
from ferrosync.storage.rendezvous import Generation
from ferrosync.storage.wire import DTYPE_CODES, KIND_CONTRIB, KIND_ERROR, Header, layout_digest

pytestmark = pytest.mark.unit

GEN = Generation(3, "0123456789abcdef", "g3.0123456789abcdef", {})
POLL = (0.001, 0.05)
INTERVAL = 0.5
N = 16
DIGEST = layout_digest("float32[16]")
NBYTES = N * 4  # the payload the layout expects


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch, objects_module)


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock, latency=0.001)


def member(storage, clock, rank, *, world=2, timeout=5.0, heartbeat_timeout=60.0, key=None,
           generation=GEN):
    monitor = PeerMonitor(storage, generation.prefix, rank, INTERVAL, heartbeat_timeout, key,
                          storage.url, clock=ProcessClock(clock))
    return GenerationObjects(storage, generation.prefix, generation, rank=rank,
                             world_size=world, key=key, poll=POLL, monitor=monitor,
                             stats=StatsBook(storage.counters), timeout=timeout,
                             url=storage.url)


def contribute(objects, value: float = 1.0, *, name=None) -> bytes:
    """``objects``' rank publishes its contribution to its current collective."""
    payload = torch.full((N,), value).numpy().tobytes()
    expected = Expected(KIND_CONTRIB, torch.float32, RawCodec(torch.float32), DIGEST,
                        Part.whole(N), objects.world_size, objects.generation.tag, objects.seq)
    header = expected.header(objects.rank, weight=1.0, nbytes=len(payload))
    objects.put(name or names.contribution(objects.seq, objects.rank), header, [payload])
    return payload


def start(*members, op="average"):
    for m in members:
        m.begin(op)


# -- writing and opening -------------------------------------------------------------------

def test_a_sealed_object_is_opened_with_its_header_checked(storage, clock):
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    payload = contribute(peer, 2.5)
    with me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES) as incoming:
        assert (incoming.header.rank, incoming.header.collective) == (1, 1)
        assert incoming.header.generation == GEN.tag
        assert incoming.read_bytes() == payload
    assert storage.counters.objects_written == 1
    assert storage.requests("list") == []  # exact names only on the collective path


def test_a_failed_owner_stops_every_put_before_it_reaches_storage(storage, clock):
    me = member(storage, clock, 0)
    start(me, op="broadcast")
    asked = []

    def failed(op):
        asked.append(op)
        raise SyncClosed("failed meanwhile (test)")

    me.before_put = failed
    with pytest.raises(SyncClosed):
        contribute(me)
    assert asked == ["broadcast"] and storage.requests("put") == []


def test_an_object_arriving_later_is_picked_up_within_one_poll(storage, clock):
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    begun = clock.now
    clock.call_later(0.7, lambda: contribute(peer))
    with me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES):
        pass
    assert 0.7 <= clock.now - begun <= 0.7 + POLL[1] + 0.01


# -- waits that end in an error ------------------------------------------------------------

def test_a_missing_object_times_out_at_the_deadline_naming_the_missing_ranks(storage, clock):
    me, one, two = (member(storage, clock, r, world=3) for r in range(3))
    start(me, one, two)
    contribute(one)
    me.gathering = {1: names.contribution(1, 1), 2: names.contribution(1, 2)}
    begun = clock.now
    with pytest.raises(SyncTimeout, match=r"ranks \[2\]") as info:
        me.wait_open(names.contribution(1, 2), [1, 2], "the contributions", NBYTES)
    assert 5.0 <= clock.now - begun <= 5.0 + POLL[1] + 0.01
    assert info.value.collective == 1 and "average" in str(info.value)


def test_a_peers_abort_marker_ends_the_wait_with_the_peers_error(storage, clock):
    me = member(storage, clock, 0, timeout=30.0)
    start(me)
    clock.call_later(1.0, lambda: publish_abort(storage, GEN.prefix, 1,
                                                LayoutMismatch("tensors differ"), 1, None))
    begun = clock.now
    with pytest.raises(LayoutMismatch, match="rank 1 failed at collective 1"):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)
    assert clock.now - begun <= 1.0 + INTERVAL + POLL[1] + 0.01  # within one check


def test_a_silent_peer_is_dead_after_the_heartbeat_timeout_not_the_collective_one(
        storage, clock):
    me = member(storage, clock, 0, timeout=30.0, heartbeat_timeout=3.0)
    start(me)
    begun = clock.now
    with pytest.raises(PeerFailed, match="rank 1 looks dead: no heartbeat"):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)
    assert 3.0 <= clock.now - begun <= 3.0 + 2 * INTERVAL + POLL[1]


def test_a_pause_of_this_process_restarts_the_collective_timeout(storage, clock):
    me = member(storage, clock, 0, timeout=5.0)
    start(me)
    begun = clock.now
    clock.call_later(1.0, lambda: clock.advance(10.0))  # SIGSTOP for 10 s at t = 1 s
    with pytest.raises(SyncTimeout):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)
    # the 5 s count again from the resumption, not from the start
    assert 1.0 + 10.0 + 5.0 <= clock.now - begun <= 16.0 + POLL[1] + 0.01


# -- what an opened object must be ---------------------------------------------------------

def test_an_object_of_another_generation_is_refused(storage, clock):
    other = Generation(3, "fedcba9876543210", GEN.prefix, {})  # same place, other token
    me, stranger = member(storage, clock, 0), member(storage, clock, 1, generation=other)
    start(me, stranger)
    contribute(stranger)
    with pytest.raises(ShardCorrupt, match="belongs to generation tag fedcba9876543210"):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)


def test_an_object_of_another_collective_is_refused(storage, clock):
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    start(peer)  # the peer is one collective ahead and writes under collective 1's name
    contribute(peer, name=names.contribution(1, 1))
    with pytest.raises(ShardCorrupt, match="collective 2, expected .* collective 1"):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)


@pytest.mark.parametrize("change", [-4, 4], ids=["truncated", "appended"])
def test_a_size_that_disagrees_with_the_header_is_refused(storage, clock, change):
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    contribute(peer)
    key = me.key_of(names.contribution(1, 1))
    data = storage.objects[key]
    storage.objects[key] = data[:change] if change < 0 else data + b"\0" * change
    with pytest.raises(ShardCorrupt, match=f"object has {len(data) + change} bytes"):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)


def test_an_object_larger_than_the_layout_allows_is_refused_by_its_size(storage, clock):
    # a planted giant at a peer's name: refused by the size storage reports, before a
    # byte of it is read (the layout says what the largest legal contribution is)
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    storage.objects[me.key_of(names.contribution(1, 1))] = bytes(2 << 20)
    with pytest.raises(ShardCorrupt, match="can have"):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)


def test_a_secret_refuses_an_object_without_a_mac(storage, clock):
    me = member(storage, clock, 0, key=b"k" * 32)
    forger = member(storage, clock, 1, key=None)
    start(me, forger)
    contribute(forger)
    with pytest.raises(ShardCorrupt, match="carries no MAC"):
        me.wait_open(names.contribution(1, 1), [1], "rank 1's contribution", NBYTES)


def test_an_error_record_raises_the_error_its_writer_reported(storage, clock):
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    peer.publish_error(names.result(1), LayoutMismatch("rank 1 summed other tensors"))
    with pytest.raises(LayoutMismatch, match="rank 1 reports: rank 1 summed other tensors"):
        me.wait_open(names.result(1), [1], "the result", NBYTES)


def test_an_unreadable_error_record_is_still_a_peer_failure(storage, clock):
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    junk = b"\xff not json"
    header = Header(kind=KIND_ERROR, dtype=DTYPE_CODES[torch.uint8], codec=0, rank=1,
                    world_size=2, generation=GEN.tag, collective=1, count=len(junk), offset=0,
                    total=len(junk), weight=0.0, layout=b"\0" * 8, payload_nbytes=len(junk))
    peer.put(names.result(1), header, [junk])
    with pytest.raises(PeerFailed, match="unreadable error record"):
        me.wait_open(names.result(1), [1], "the result", NBYTES)


# -- naming the difference of a layout mismatch ----------------------------------------------

def test_a_mismatch_names_the_first_differing_tensor_from_the_peers_record(storage, clock):
    me, peer = member(storage, clock, 0), member(storage, clock, 1)
    start(me, peer)
    mine = {"op": "average", "bucket": "0/1", "tensors": ["float32[16]", "float32[4]"]}
    theirs = {"op": "average", "bucket": "0/1", "tensors": ["float32[16]", "float32[5]"]}
    their_digest = layout_digest("theirs")
    me.ensure_layout(DIGEST, mine)
    peer.ensure_layout(their_digest, theirs)
    peer.ensure_layout(their_digest, theirs)  # once per digest
    assert len(storage.requests("put", "*/layout*")) == 2
    error = me.mismatch(1, their_digest, DIGEST, "somewhere")
    assert isinstance(error, LayoutMismatch)
    assert "first difference at tensor 1: rank 0 has float32[4], rank 1 has float32[5]" in str(
        error)
    unknown = me.mismatch(1, layout_digest("unpublished"), DIGEST, "somewhere")
    assert "its layout record is missing" in str(unknown)


# -- the layer's whole-object reads (what an elastic round uses) ----------------------------

def layer(storage, key=None):
    return objects_module.Objects(storage, "el.unit", key=key, tag=GEN.tag, poll=POLL)


@pytest.mark.unit
def test_a_sized_read_returns_a_legal_object_and_none_for_a_missing_one(storage):
    storage.objects["el.unit/k"] = b"12345678"
    assert layer(storage).read_sized("k", (4, 8)) == b"12345678"
    assert layer(storage).read_sized("missing", (4, 8)) is None


@pytest.mark.unit
def test_a_sized_read_refuses_another_size_reading_no_more_than_the_largest(storage):
    storage.objects["el.unit/k"] = b"123456"
    with pytest.raises(ShardCorrupt, match="has 6 bytes; an object of this kind has 4 or 8"):
        layer(storage).read_sized("k", (8, 4, 8))
    storage.objects["el.unit/k"] = b"x" * (1 << 20)  # a forged object claiming a large size
    before = storage.counters.snapshot()["bytes_read"]
    with pytest.raises(ShardCorrupt, match="refused unread"):
        layer(storage).read_sized("k", (8, 16))
    assert storage.counters.snapshot()["bytes_read"] == before


def _contribution(objects, n: int, digest: bytes, *, weight=1.0):
    expected = Expected(KIND_CONTRIB, torch.float32, RawCodec(torch.float32), digest,
                        Part.whole(n), 2, GEN.tag, 5)
    payload = torch.full((n,), 1.5).numpy().tobytes()
    assert objects.create("obj", expected.header(1, weight=weight, nbytes=len(payload)),
                          [payload])
    return expected, payload


@pytest.mark.unit
@pytest.mark.parametrize("key", [None, b"k" * 32], ids=["checksum", "mac"])
def test_a_verified_read_names_another_layout_only_once_its_mac_verified(storage, key):
    objects = layer(storage, key)
    theirs, _ = _contribution(objects, N + 4, layout_digest("theirs"))
    mine = Expected(KIND_CONTRIB, torch.float32, RawCodec(torch.float32), DIGEST,
                    Part.whole(N), 2, GEN.tag, 5)
    sizes = (objects.head, objects.head + NBYTES)
    named = []

    def mismatch(src, digest):
        named.append((src, digest))
        return LayoutMismatch("another layout")

    with pytest.raises(LayoutMismatch):
        objects.read_verified("obj", mine, 1, sizes=sizes, mismatch=mismatch,
                              other_layouts=True)
    assert named == [(1, theirs.digest)]
    with pytest.raises(ShardCorrupt, match="can have"):  # no room for another layout
        objects.read_verified("obj", mine, 1, sizes=sizes, mismatch=mismatch)
    data = bytearray(storage.objects["el.unit/obj"])  # the same object, one bit flipped
    data[-1] ^= 1
    storage.objects["el.unit/obj"] = bytes(data)
    with pytest.raises(ShardCorrupt, match="mismatch"):
        objects.read_verified("obj", mine, 1, sizes=sizes, mismatch=mismatch,
                              other_layouts=True)
    assert len(named) == 1  # a forgery is never reported as a layout


@pytest.mark.unit
def test_a_second_create_of_one_name_says_so_and_counts_once(storage):
    objects = layer(storage)
    _contribution(objects, N, DIGEST)
    expected = Expected(KIND_CONTRIB, torch.float32, RawCodec(torch.float32), DIGEST,
                        Part.whole(N), 2, GEN.tag, 5)
    assert not objects.create("obj", expected.header(1, weight=1.0, nbytes=0), [])
    assert storage.counters.objects_written == 1
    header, payload = objects.read_verified("obj", expected, 1, sizes=(objects.head + NBYTES,),
                                            mismatch=None)
    assert header.weight == 1.0 and bytes(payload) == torch.full((N,), 1.5).numpy().tobytes()
