"""``ferrosync.storage.rendezvous`` in one process: generations, claims, objections, windows.

Every rank runs on one thread over a ``MemoryStorage`` and a ``FakeClock``
(tests/fakes.py): "rank 0 arrives 0.5 s later" is an action the clock runs inside
rank 1's wait, so each test is deterministic and takes milliseconds, and a timeout is
checked at the fake instant it must happen. The claim's guard thread runs on real
time, so it is not started here; its duty (``Claim.guard_once``) is called directly.
The same protocol across real processes and stores: tests/test_failures.py,
tests/test_jobs.py.
"""

from __future__ import annotations

import math

import pytest

from fakes import FakeClock, MemoryStorage
from ferrosync.errors import ConfigError, DuplicateRank, StorageError, SyncTimeout
from ferrosync.storage import rendezvous as rdzv
from ferrosync.storage.wire import decode_record

pytestmark = pytest.mark.unit

JOB = "unit"
NS = rdzv.namespace(JOB)
POLL = (0.001, 0.05)
INTERVAL = 0.5  # heartbeat interval: the objection window is 2 * 0.5 + 1 = 2 s
SETTINGS = {"reduce": "root", "wire_dtype": None}


@pytest.fixture
def clock(monkeypatch):
    # the guard thread would run on real time beside the fake clock
    monkeypatch.setattr(rdzv.Claim, "start_guard", lambda self, interval: None)
    return FakeClock().install(monkeypatch, rdzv)


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock, latency=0.001)


def meet(storage, rank, world, *, settings=SETTINGS, timeout=30.0, key=None, job=JOB,
         claim_window=None):
    return rdzv.rendezvous(storage, rank, world, dict(settings), key=key, timeout=timeout,
                           poll=POLL, heartbeat_interval=INTERVAL, url=storage.url, job=job,
                           claim_window=claim_window)


def later(clock, delay, fn, out, name):
    """At ``delay`` s from now, run ``fn()``; its result or error lands in ``out[name]``."""
    def run():
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[name] = exc

    clock.call_later(delay, run)


def stale_claim(storage, rank, *, ended):
    """A claim of an earlier process on ``rank``, closed cleanly or not (SIGKILL)."""
    claim = rdzv.Claim(storage, NS, rank, None, {"token": "0" * 16, "pid": 1, "host": "old"})
    claim.write()
    if ended:
        claim.release()
    return claim


# -- first_missing -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 2, 5, 64, 1000])
def test_first_missing_finds_the_first_free_index_in_logarithmic_probes(n):
    storage = MemoryStorage()
    for i in range(n):
        storage.objects[f"k{i}"] = b""
    assert rdzv.first_missing(storage, lambda i: f"k{i}") == n
    probes = len(storage.requests("open"))
    assert probes <= 2 * math.ceil(math.log2(n + 1)) + 2, probes
    assert rdzv.first_missing(storage, lambda i: f"k{i}", start=n) == n


# -- generations ---------------------------------------------------------------------------

def test_a_restart_gets_a_new_generation_with_a_new_token(storage, clock):
    first = meet(storage, 0, 1)
    first.claim.release()
    second = meet(storage, 0, 1)
    second.claim.release()
    assert (first.number, second.number) == (0, 1)
    assert first.token != second.token and first.prefix != second.prefix
    assert second.prefix == f"g1.{second.token}"
    # the announcement names which claim of each rank it consumed: the restart's
    record = decode_record(storage.objects[rdzv.gen_key(NS, 1)], None, path="gen.1")
    assert record["joins"] == {"0": [1, second.claim.token]}
    assert clock.slept == 0.0  # a world of one with a job id never waits


def test_two_ranks_agree_on_one_generation(storage, clock):
    out = {}
    start = clock.now
    later(clock, 0.5, lambda: meet(storage, 0, 2), out, 0)  # rank 0 starts later
    rank1 = meet(storage, 1, 2)
    rank0 = out[0]
    assert rank0.number == rank1.number == 0
    assert rank0.token == rank1.token and rank0.prefix == rank1.prefix
    assert rank1.settings == SETTINGS
    assert 0.5 <= clock.now - start < 1.0  # rank 1 waited for the announcement, no longer


def test_disagreeing_settings_fail_every_rank_at_connect_not_at_the_timeout(storage, clock):
    out = {}
    start = clock.now
    later(clock, 0.5, lambda: meet(storage, 0, 2), out, 0)
    with pytest.raises(ConfigError, match="ranks disagree") as info:
        meet(storage, 1, 2, settings={**SETTINGS, "wire_dtype": "int8"}, timeout=30.0)
    assert "wire_dtype='int8'" in str(info.value)
    assert isinstance(out[0], ConfigError) and "rank 1 has wire_dtype='int8'" in str(out[0])
    assert clock.now - start < 1.0
    # both claims were ended on the way out: a restart need not wait for objections
    for rank in (0, 1):
        assert rdzv.end_key(NS, rank, 0) in storage.objects


def test_different_secrets_are_named_as_the_likely_cause(storage, clock):
    out = {}
    later(clock, 0.5, lambda: meet(storage, 0, 2, key=b"k" * 32), out, 0)
    with pytest.raises(ConfigError, match="cannot read rank 0's announcement"):
        meet(storage, 1, 2, key=None)
    assert isinstance(out[0], ConfigError) and "secrets" in str(out[0])


def test_missing_rank_0_is_a_timeout_at_the_deadline(storage, clock):
    start = clock.now
    with pytest.raises(SyncTimeout, match="waiting for rank 0 to announce generation 0") as info:
        meet(storage, 1, 2, timeout=5.0)
    waited = clock.now - start
    assert 5.0 <= waited <= 5.0 + POLL[1] + 0.01, waited
    assert info.value.rank == 1 and "WORLD_SIZE=2" in str(info.value)
    assert rdzv.end_key(NS, 1, 0) in storage.objects  # the claim was released


def test_rank_0_names_every_rank_that_never_joined(storage, clock):
    rdzv.Claim(storage, NS, 1, None, {"token": "1" * 16, "world_size": 3,
                                      "settings": SETTINGS}).write()
    with pytest.raises(SyncTimeout, match=r"ranks \[2\] to join"):
        meet(storage, 0, 3, timeout=2.0)


def test_a_failed_announcement_is_a_storage_error_and_ends_the_claim(storage, clock):
    storage.fail("put", f"{NS}/gen.0", StorageError("injected: disk full", path="gen.0"))
    with pytest.raises(StorageError, match="disk full"):
        meet(storage, 0, 1)
    assert rdzv.end_key(NS, 0, 0) in storage.objects
    again = meet(storage, 0, 1)  # the restart takes the next claim, the same free index
    assert (again.number, again.claim.attempt) == (0, 1)


# -- claims and objections -----------------------------------------------------------------

def test_a_lost_claim_race_takes_the_next_attempt(storage, clock):
    # another process creates join.r1.0 between our probe and our exclusive create
    storage.before("put", f"{NS}/join.r1.0",
                   lambda key: storage.objects.__setitem__(key, b"someone else"))
    claim = rdzv.Claim(storage, NS, 1, None, {"token": "2" * 16})
    claim.write()
    assert claim.attempt == 1 and storage.objects[rdzv.join_key(NS, 1, 0)] == b"someone else"


def test_a_running_holder_objects_and_only_the_newcomer_fails(storage, clock):
    holder = stale_claim(storage, 1, ended=False)
    newcomer = rdzv.Claim(storage, NS, 1, None, {"token": "3" * 16})
    newcomer.write()
    assert newcomer.attempt == 1 and not newcomer.previous_ended()
    holder.guard_once()  # what the holder's guard thread does every interval
    holder.guard_once()  # once per claim: no second objection
    assert storage.requests("put", f"{NS}/dup.r1.*") == [f"{NS}/dup.r1.1"]
    # the objection names the objector (this test's process, as the holder)
    with pytest.raises(DuplicateRank, match=r"rank 1 is still running \(pid \d+ on .*attempt 0\)"):
        newcomer.check()


def test_a_joining_holder_fails_too_when_a_later_claim_appears(storage, clock):
    joining = stale_claim(storage, 1, ended=False)
    rdzv.Claim(storage, NS, 1, None, {"token": "4" * 16}).write()
    with pytest.raises(DuplicateRank, match="while this one .attempt 0. was joining"):
        joining.check()
    assert rdzv.objection_key(NS, 1, 1) in storage.objects  # and it objected first


@pytest.mark.parametrize("ended", [True, False], ids=["closed", "killed"])
def test_a_restart_waits_an_objection_window_only_after_an_unclean_end(storage, clock, ended):
    stale_claim(storage, 1, ended=ended)
    out = {}
    later(clock, 0.1, lambda: meet(storage, 0, 2), out, 0)
    rank1 = meet(storage, 1, 2)
    waited = clock.now - rank1.claim.written_at
    assert out[0].token == rank1.token and rank1.claim.attempt == 1
    if ended:
        assert waited < 0.5, waited
    else:
        assert 2 * INTERVAL + 1.0 <= waited < 2 * INTERVAL + 1.0 + POLL[1] + 0.01, waited


def test_a_live_holder_objecting_within_the_window_stops_the_restart(storage, clock):
    holder = stale_claim(storage, 1, ended=False)  # alive, merely slow to look
    out = {}
    later(clock, 0.1, lambda: meet(storage, 0, 2), out, 0)
    clock.call_later(1.5, holder.guard_once)  # inside the 2 s objection window
    with pytest.raises(DuplicateRank, match="still running"):
        meet(storage, 1, 2)


def test_an_anonymous_job_waits_its_claim_window(storage, clock):
    out, done = {}, {}

    def rank0():
        generation = meet(storage, 0, 2, job=None)
        done[0] = clock.now
        return generation

    later(clock, 0.1, rank0, out, 0)
    rank1 = meet(storage, 1, 2, job=None)
    assert rank1.number == out[0].number == 0
    window = rdzv.ANONYMOUS_CLAIM_WINDOW
    # each rank waits its window from its own claim (rank 0 claimed 0.1 s later)
    assert window <= done[0] - out[0].claim.written_at < window + 0.1
    assert window <= clock.now - rank1.claim.written_at < window + 0.1 + 0.1
