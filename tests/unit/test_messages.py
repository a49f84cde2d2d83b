"""``storage/messages.py`` in one process: point-to-point messages through a ``Mailbox``.

Every rank's ``Mailbox`` sits on its own ``GenerationObjects`` over one ``MemoryStorage``
and a ``FakeClock`` (tests/fakes.py); the monitor is the real ``PeerMonitor`` on that
clock. A send that happens "later" is an action the clock runs inside the receiver's
wait, so waits and timeouts are exact and take milliseconds. The threaded end-to-end
tests through ``connect`` are in tests/test_ddp_p2p.py; here is the contract of the
mailbox itself: numbering per (source, destination, tag), receiving from any source,
consuming what was read, and refusing what another pair, tag, generation or size left.
"""

from __future__ import annotations

import pytest
import torch

from fakes import FakeClock, MemoryStorage
from ferrosync.core.stats import StatsBook
from ferrosync.errors import LayoutMismatch, PeerFailed, ShardCorrupt, SyncTimeout
from ferrosync.storage import messages as messages_module
from ferrosync.storage import names
from ferrosync.storage import objects as objects_module
from ferrosync.storage.liveness import (
    PeerMonitor,
    ProcessClock,
    abort_key,
    heartbeat_key,
    publish_abort,
)
from ferrosync.storage.messages import Mailbox, message_digest
from ferrosync.storage.objects import GenerationObjects
from ferrosync.storage.rendezvous import Generation
from ferrosync.storage.wire import encode_record

GEN = Generation(2, "0123456789abcdef", "g2.0123456789abcdef", {})
POLL = (0.001, 0.05)
INTERVAL = 0.5
SECRET = b"s" * 32


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch, objects_module, messages_module)


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock, latency=0.001)


def mailbox(storage, clock, rank, *, world=2, timeout=5.0, key=None, generation=GEN):
    monitor = PeerMonitor(storage, generation.prefix, rank, INTERVAL, 60.0, key, storage.url,
                          clock=ProcessClock(clock))
    stats = StatsBook(storage.counters)
    objects = GenerationObjects(storage, generation.prefix, generation, rank=rank,
                                world_size=world, key=key, poll=POLL, monitor=monitor,
                                stats=stats, timeout=timeout, url=storage.url)
    return Mailbox(objects, world_size=world, monitor=monitor, stats=stats, timeout=timeout,
                   pool=None, chunk_bytes=1 << 16)


def key_of(src, dst, tag, number, generation=GEN):
    return names.within(generation.prefix, names.message(src, dst, tag, number))


# -- the contract: numbering, order, consumption -----------------------------------------------

def test_messages_are_numbered_per_destination_and_tag_and_read_once(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1)
    sent = [torch.arange(4.0), torch.arange(4.0) + 10, torch.arange(4.0) + 20]
    assert [zero.send(sent[0], 1, 0), zero.send(sent[1], 1, 0), zero.send(sent[2], 1, 7)] \
        == [0, 1, 0]  # tag 7 counts on its own
    assert sorted(storage.objects) == sorted(
        [key_of(0, 1, 0, 0), key_of(0, 1, 0, 1), key_of(0, 1, 7, 0)])
    out = torch.empty(4)
    assert one.receive(out, 0, 7) == 0 and torch.equal(out, sent[2])  # another tag first
    for want in sent[:2]:
        assert one.receive(out, 0, 0) == 0 and torch.equal(out, want)
    assert storage.objects == {}  # its one reader deleted each message once read
    assert clock.slept == 0.0  # everything was there: no wait


def test_a_posted_receive_gets_the_message_of_its_turn_whenever_it_is_read(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1)
    first, second = one.post(0, 3), one.post(0, 3)
    assert (first, second) == (0, 1)
    zero.send(torch.tensor([1.0]), 1, 3)
    zero.send(torch.tensor([2.0]), 1, 3)
    out = torch.empty(1)
    one.receive(out, 0, 3, second)  # waited out of order: still matched as posted
    assert out.item() == 2.0
    one.receive(out, 0, 3, first)
    assert out.item() == 1.0
    zero.send(torch.tensor([3.0]), 1, 3)
    one.receive(out, 0, 3)  # an unposted receive takes the next number: 2
    assert out.item() == 3.0


def test_any_source_takes_the_lowest_rank_and_keeps_each_ranks_order(storage, clock):
    boxes = [mailbox(storage, clock, r, world=3) for r in range(3)]
    boxes[2].send(torch.tensor([20.0]), 0, 0)
    boxes[2].send(torch.tensor([21.0]), 0, 0)
    boxes[1].send(torch.tensor([10.0]), 0, 0)
    out = torch.empty(1)
    got = [(boxes[0].receive(out, None, 0), out.item()) for _ in range(2)]
    assert got == [(1, 10.0), (2, 20.0)]
    # rank 2's counter moved only by the message taken: its next one is number 1
    assert boxes[0].receive(out, 2, 0) == 2 and out.item() == 21.0


def test_a_non_blocking_receive_returns_none_at_once_and_consumes_no_number(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1)
    out = torch.empty(2)
    assert one.receive(out, None, 0, block=False) is None
    assert clock.slept == 0.0
    zero.send(torch.tensor([5.0, 6.0]), 1, 0)
    assert one.receive(out, None, 0, block=False) == 0 and out.tolist() == [5.0, 6.0]


def test_empty_and_non_float_tensors_travel_exactly(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1)
    sent = [torch.empty(0), torch.tensor([True, False, True]), torch.tensor([2**40, -7]),
            torch.tensor([1 + 2j], dtype=torch.complex64)]
    for t in sent:
        zero.send(t, 1, 0)
    for t in sent:
        out = torch.empty_like(t)
        one.receive(out, 0, 0)
        assert out.dtype == t.dtype and torch.equal(out, t)


def test_a_message_sent_later_is_picked_up_within_one_poll(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1)
    begun = clock.now
    clock.call_later(1.3, lambda: zero.send(torch.tensor([4.0]), 1, 0))
    out = torch.empty(1)
    assert one.receive(out, 0, 0) == 0 and out.item() == 4.0
    assert 1.3 <= clock.now - begun <= 1.3 + POLL[1] + 0.01


# -- waits that end in an error ----------------------------------------------------------------

@pytest.mark.parametrize("src, which", [(0, "message 0 from rank 0"),
                                        (None, "a message from any rank")])
def test_a_message_never_sent_times_out_at_the_deadline_naming_it(storage, clock, src, which):
    one = mailbox(storage, clock, 1, timeout=4.0)
    begun = clock.now
    with pytest.raises(SyncTimeout) as info:
        one.receive(torch.empty(1), src, 6)
    assert 4.0 <= clock.now - begun <= 4.0 + POLL[1] + 0.01
    text = str(info.value)
    assert f"timed out after 4 s in recv waiting for {which} (tag 6)" in text
    assert info.value.rank == 1 and GEN.prefix in text
    assert "does the sending rank call send with this rank and tag" in text


def test_a_sender_that_aborted_fails_the_receive_with_its_error(storage, clock):
    one = mailbox(storage, clock, 1, timeout=30.0)
    clock.call_later(1.0, lambda: publish_abort(storage, GEN.prefix, 0,
                                                LayoutMismatch("rank 0 broke"), None, None))
    begun = clock.now
    with pytest.raises(LayoutMismatch, match="rank 0 failed with LayoutMismatch"):
        one.receive(torch.empty(1), 0, 0)
    assert clock.now - begun <= 1.0 + INTERVAL + POLL[1] + 0.01  # within one check


def _closed(storage, rank):
    storage.put(heartbeat_key(GEN.prefix, rank),
                [encode_record({"beat": 9, "state": "closed", "collective": 0}, None)])


def test_a_sender_that_closed_without_sending_fails_the_receive(storage, clock):
    one = mailbox(storage, clock, 1, timeout=30.0)
    _closed(storage, 0)
    with pytest.raises(PeerFailed, match="rank 0 closed its connection"):
        one.receive(torch.empty(1), 0, 0)


def test_a_message_sent_just_before_its_sender_closed_is_still_read(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1, timeout=30.0)
    _closed(storage, 0)
    # the message lands after the receiver's last look, just before its liveness check
    storage.before("open", abort_key(GEN.prefix, 0),
                   lambda key: zero.send(torch.tensor([8.0]), 1, 0))
    out = torch.empty(1)
    assert one.receive(out, 0, 0) == 0 and out.item() == 8.0


# -- what a message must be: hostile and mistaken objects --------------------------------------

def test_a_message_of_another_size_or_dtype_is_a_layout_mismatch_and_kept(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1)
    zero.send(torch.arange(4.0), 1, 0)
    with pytest.raises(LayoutMismatch) as info:
        one.receive(torch.empty(5), 0, 0)
    assert "rank 0 sent 4 elements of torch.float32 as message 0 from rank 0 (tag 0)" in str(
        info.value) and "receives 5 of torch.float32" in str(info.value)
    assert "same dtype and size" in str(info.value)
    assert key_of(0, 1, 0, 0) in storage.objects  # refused, not consumed
    with pytest.raises(LayoutMismatch, match="receives 4 of torch.int32"):
        one.receive(torch.empty(4, dtype=torch.int32), 0, 0, 0)  # same bytes, other dtype


def test_a_message_moved_to_another_tag_or_pair_is_refused(storage, clock):
    zero, one = mailbox(storage, clock, 0), mailbox(storage, clock, 1)
    zero.send(torch.arange(3.0), 1, 0)
    storage.objects[key_of(0, 1, 9, 0)] = storage.objects.pop(key_of(0, 1, 0, 0))
    with pytest.raises(ShardCorrupt, match="another pair's or tag's digest"):
        one.receive(torch.empty(3), 0, 9)
    assert len({message_digest(0, 1, 0), message_digest(0, 1, 9), message_digest(1, 0, 0),
                message_digest(0, 2, 0)}) == 4


def test_a_message_of_another_generation_is_refused(storage, clock):
    other = Generation(2, "fedcba9876543210", GEN.prefix, {})  # same place, another token
    stranger, one = mailbox(storage, clock, 0, generation=other), mailbox(storage, clock, 1)
    stranger.send(torch.arange(3.0), 1, 0)
    with pytest.raises(ShardCorrupt, match="belongs to generation tag fedcba9876543210"):
        one.receive(torch.empty(3), 0, 0)


def test_a_planted_giant_is_refused_by_its_size_unread(storage, clock):
    one = mailbox(storage, clock, 1)
    storage.objects[key_of(0, 1, 0, 0)] = bytes(4 << 20)
    before = storage.counters.snapshot()["bytes_read"]
    with pytest.raises(ShardCorrupt, match="bytes, more than"):
        one.receive(torch.empty(3), 0, 0)
    assert storage.counters.snapshot()["bytes_read"] == before


def test_a_tampered_payload_is_refused(storage, clock):
    zero, one = mailbox(storage, clock, 0, key=SECRET), mailbox(storage, clock, 1, key=SECRET)
    zero.send(torch.arange(8.0), 1, 0)
    data = bytearray(storage.objects[key_of(0, 1, 0, 0)])
    data[-1] ^= 1
    storage.objects[key_of(0, 1, 0, 0)] = bytes(data)
    with pytest.raises(ShardCorrupt, match="MAC"):
        one.receive(torch.empty(8), 0, 0)
    assert key_of(0, 1, 0, 0) in storage.objects  # nothing verified is consumed


def test_a_secret_refuses_a_message_without_a_mac(storage, clock):
    forger, one = mailbox(storage, clock, 0, key=None), mailbox(storage, clock, 1, key=SECRET)
    forger.send(torch.arange(2.0), 1, 0)
    with pytest.raises(ShardCorrupt, match="carries no MAC"):
        one.receive(torch.empty(2), 0, 0)
