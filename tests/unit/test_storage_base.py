"""``storage/engines/base.py`` over the in-memory store (tests/fakes.py): keys, counters, the
size rule, retries of transient failures only, the polling back-off and the location
probe every job runs before it writes anything."""

from __future__ import annotations

import errno
import threading

import pytest

from fakes import FakeClock, MemoryStorage
from ferrosync.core import runtime
from ferrosync.core.runtime import Backoff
from ferrosync.errors import ConfigError, ExclusiveCreateUnsupported, ShardCorrupt, StorageError
from ferrosync.storage.engines import base
from ferrosync.storage.engines.base import (
    RECORD_LIMIT,
    Counters,
    check_key,
    object_exists,
    probe_location,
)


@pytest.mark.parametrize("key", ["/abs", "a/../b", "a//b", "./a", "a/.", "a\\b", "a\0b", ""])
def test_check_key_refuses_escapes_and_empty_parts(key):
    with pytest.raises(ConfigError, match="invalid storage key"):
        check_key(key)


def test_check_key_passes_relative_posix_paths():
    assert check_key("g1/c17.r0") == "g1/c17.r0"
    assert check_key(".hidden/x..y") == ".hidden/x..y"


def test_counters_count_each_kind_in_requests_too_and_from_many_threads():
    counters = Counters()

    def work():
        for _ in range(1000):
            counters.add(requests=1, puts=1, gets=2, written=10, read=3, objects=1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters.snapshot() == {
        "requests": 4000 * 4, "bytes_written": 40000, "bytes_read": 12000,
        "objects_written": 4000, "puts": 4000, "gets": 8000, "deletes": 0, "lists": 0}


def test_read_refuses_an_object_larger_than_its_kind_unread():
    storage = MemoryStorage()
    storage.objects["hb.r0"] = b"x" * (RECORD_LIMIT + 1)
    with pytest.raises(ShardCorrupt, match=rf"has {RECORD_LIMIT + 1} bytes, more than"):
        storage.read("hb.r0", rank=2)
    assert storage.counters.bytes_read == 0
    assert storage.read("missing") is None


def test_object_exists_opens_the_exact_name():
    storage = MemoryStorage()
    storage.objects["a/b"] = b"1"
    assert object_exists(storage, "a/b") and not object_exists(storage, "a/c")
    assert storage.requests("open") == ["a/b", "a/c"]
    assert not storage.requests("list")  # exact names, never a listing


class _Flaky(MemoryStorage):
    """A store whose ``put`` goes through ``Storage.retry``, as the engines' do."""

    retries = 3

    def __init__(self, *errors):
        super().__init__()
        self.errors = list(errors)
        self.recovered = 0

    def put(self, key, parts, **kwargs):
        def attempt():
            if self.errors:
                raise self.errors.pop(0)
            return super(_Flaky, self).put(key, parts, **kwargs)

        return self.retry("put", key, attempt)

    def _recover(self):
        self.recovered += 1


@pytest.fixture
def no_sleep(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(base, "time", clock)
    return clock


def test_transient_failures_are_retried_with_a_bounded_back_off(no_sleep):
    storage = _Flaky(OSError(errno.EIO, "i/o"), TimeoutError("slow"), OSError(errno.ESTALE, "s"))
    assert storage.put("k", [b"abc"]) == 3 and storage.objects["k"] == b"abc"
    assert storage.recovered == 3
    assert no_sleep.slept == pytest.approx(0.05 + 0.2 + 0.8)


def test_a_store_that_keeps_failing_gives_a_storage_error_with_the_path(no_sleep):
    storage = _Flaky(*[OSError(errno.EIO, "i/o")] * 4)
    with pytest.raises(StorageError, match=r"at mem://test/k: put failed \(OSError") as info:
        storage.put("k", [b"abc"])
    assert "check that it is reachable" in info.value.hint
    assert storage.recovered == 3 and "k" not in storage.objects


@pytest.mark.parametrize("exc", [FileNotFoundError("gone"), FileExistsError("taken"),
                                 StorageError("already said", path="p")])
def test_answers_and_our_own_errors_pass_straight_through(no_sleep, exc):
    storage = _Flaky(exc)
    with pytest.raises(type(exc)):
        storage.put("k", [b"x"])
    assert storage.recovered == 0 and no_sleep.slept == 0


def test_a_permanent_failure_is_not_retried_and_says_what_to_do(no_sleep):
    storage = _Flaky(OSError(errno.ENOSPC, "full"))
    with pytest.raises(StorageError, match="the storage is full"):
        storage.put("k", [b"x"])
    assert no_sleep.slept == 0


def test_backoff_doubles_to_its_cap_and_never_sleeps_past_the_deadline(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(runtime, "time", clock)
    backoff = Backoff(0.001, 0.004)
    sleeps = []
    for _ in range(5):
        before = clock.now
        backoff.sleep(deadline=clock.now + 1.0)
        sleeps.append(round(clock.now - before, 6))
    assert sleeps == [0.001, 0.002, 0.004, 0.004, 0.004]
    before = clock.now
    backoff.sleep(deadline=clock.now + 0.0005)
    assert clock.now - before == pytest.approx(0.0005)
    backoff.sleep(deadline=clock.now - 1.0)  # past the deadline: no sleep at all
    assert clock.now - before == pytest.approx(0.0005)


def test_probe_passes_a_store_that_creates_exclusively_and_leaves_nothing():
    storage = MemoryStorage()
    probe_location(storage, rank=1)
    assert storage.objects == {}
    assert [op for op, _ in storage.log] == ["put", "open", "put", "delete"]


def test_probe_refuses_a_store_that_overwrites_on_exclusive_create():
    class Overwrites(MemoryStorage):
        def put(self, key, parts, *, exclusive=False, reuse=None):
            return super().put(key, parts, reuse=reuse)

    with pytest.raises(ConfigError, match="cannot create an object exclusively "
                       r"\(a second create of one name succeeded") as info:
        probe_location(Overwrites(), rank=0, what="sync URL")
    assert info.value.rank == 0 and "doctor" in info.value.hint


def test_probe_refuses_a_driver_without_exclusive_create_and_a_checkpoint_place_skips_it():
    class NoExclusive(MemoryStorage):
        def put(self, key, parts, *, exclusive=False, reuse=None):
            if exclusive:
                raise ExclusiveCreateUnsupported("this driver ignores mode='create'")
            return super().put(key, parts, reuse=reuse)

    with pytest.raises(ConfigError, match="this driver ignores mode='create'"):
        probe_location(NoExclusive())
    probe_location(NoExclusive(), exclusive=False)  # checkpoints never create exclusively


def test_probe_names_the_rank_and_location_when_the_store_fails():
    storage = MemoryStorage("mem://bucket/run")
    storage.fail("put", "*", StorageError("put failed (denied)", hint="check the creds"))
    with pytest.raises(ConfigError) as info:
        probe_location(storage, rank=3, what="this location")
    assert str(info.value) == ("rank 3, at mem://bucket/run: cannot use this location (put "
                               "failed (denied)); check the creds")


def test_probe_refuses_a_store_that_reads_back_other_bytes():
    class Stale(MemoryStorage):
        def open(self, key, **kwargs):
            self.objects[key] = b"yesterday"
            return super().open(key, **kwargs)

    with pytest.raises(ConfigError, match="read-after-write returned different bytes"):
        probe_location(Stale())


def test_probe_puts_the_rank_on_a_missing_bucket_error():
    class NoBucket(MemoryStorage):
        def probe_bucket(self):
            raise ConfigError("bucket 'b' does not exist", path="s3://b")

    with pytest.raises(ConfigError, match="^rank 2, at s3://b: bucket 'b' does not exist"):
        probe_location(NoBucket(), rank=2)
