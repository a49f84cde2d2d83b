"""``ferrosync.elastic.membership`` in one process: heartbeats, the silence rule, rosters.

Every member is an object over one ``MemoryStorage`` and a ``FakeClock``
(tests/fakes.py). The one process clock the liveness rule reads
(``liveness.PROCESS_CLOCK``) is replaced by one ticking on the fake clock, so "silent
for 5 s" and "frozen for 100 s" are instants the test sets, not waits: each test is
deterministic and takes milliseconds. Heartbeats are written by calling the writer's
beat directly (its thread would run on real time). The same protocol across real
processes: tests/test_elastic.py, tests/test_elastic_trust.py.
"""

from __future__ import annotations

import json

import pytest

from fakes import MemoryStorage, install_elastic_clock
from ferrosync.elastic import membership as mb
from ferrosync.errors import FerrosyncError, ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage import objects as objects_module
from ferrosync.storage.engines import RECORD_LIMIT
from ferrosync.storage.objects import Objects
from ferrosync.storage.wire import decode_record, encode_record, job_key, job_tag

NS = names.elastic_namespace("unit")
SECRET = job_key(b"team secret", NS)
INTERVAL = 0.5
TIMEOUT = 5.0
A, B, C = "a" * 16, "b" * 16, "c" * 16


@pytest.fixture
def clock(monkeypatch):
    return install_elastic_clock(monkeypatch, objects_module)


def layer(storage, secret=SECRET):
    """The job's object layer over ``storage`` (what a member builds at connect)."""
    return Objects(storage, NS, key=secret, tag=job_tag(NS), poll=(0.01, 0.1))


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock, latency=0.001)


def watch(storage, secret=SECRET):
    return mb.HeartbeatWatch(layer(storage, secret), TIMEOUT, INTERVAL)


def hb_key(member):
    return names.within(NS, names.elastic_heartbeat(member))


def record_at(storage, key, secret=SECRET):
    return decode_record(storage.objects[key], secret, path=key)


def run_for(clock, seconds, look, step=INTERVAL):
    """Call ``look()`` every ``step`` s for ``seconds`` (a member's polling loop)."""
    end = clock.now + seconds
    while clock.now < end:
        look()
        clock.advance(step)


# -- the heartbeat writer -------------------------------------------------------------------

@pytest.mark.unit
def test_heartbeat_writes_the_member_id_an_increasing_beat_and_its_final_state(storage):
    hb = mb.heartbeat(layer(storage), A, INTERVAL)
    hb.announce(mb.ALIVE)
    first = record_at(storage, hb_key(A))
    hb.announce(mb.ALIVE)
    second = record_at(storage, hb_key(A))
    assert (first["id"], first["state"]) == (A, "alive")
    assert second["beat"] == first["beat"] + 1
    hb.stop(mb.LEFT)
    assert record_at(storage, hb_key(A))["state"] == "left"
    with pytest.raises(ShardCorrupt, match="authenticated"):  # sealed with the job key
        record_at(storage, hb_key(A), secret=None)


# -- HeartbeatWatch: the silence rule ----------------------------------------------------------

@pytest.mark.unit
def test_a_member_that_keeps_beating_stays_alive(storage, clock):
    hb = mb.heartbeat(layer(storage), A, INTERVAL)
    w = watch(storage)
    run_for(clock, 4 * TIMEOUT, lambda: (hb.announce(mb.ALIVE), w.state(A)))
    assert w.alive(A) and A not in w.gone


@pytest.mark.unit
def test_a_member_whose_beat_stops_is_silent_after_the_timeout_not_before(storage, clock):
    hb = mb.heartbeat(layer(storage), A, INTERVAL)
    hb.announce(mb.ALIVE)
    w = watch(storage)
    start = clock.now
    states = []
    while (not states or states[-1] == "alive") and len(states) < 100:
        states.append(w.state(A))
        clock.advance(INTERVAL)
    silent_after = clock.now - INTERVAL - start
    assert states[-1] == "silent"
    assert TIMEOUT < silent_after <= TIMEOUT + INTERVAL + 0.01
    # gone for good: it is not read again, even if it beats again
    hb.announce(mb.ALIVE)
    reads = len(storage.requests("open", hb_key(A)))
    assert w.state(A) == "gone" and not w.alive(A)
    assert len(storage.requests("open", hb_key(A))) == reads


@pytest.mark.unit
def test_a_member_never_seen_beating_is_silent_one_timeout_after_the_first_look(storage, clock):
    w = watch(storage)
    start = clock.now
    assert w.alive(B)  # no heartbeat yet: its silence clock starts now
    run_for(clock, TIMEOUT - 0.1, lambda: w.state(B), step=0.1)
    assert w.alive(B) and TIMEOUT - 0.1 <= clock.now - start < TIMEOUT + 0.01
    clock.advance(0.2)
    assert w.state(B) == "silent"


@pytest.mark.parametrize("final", [mb.LEFT, mb.ABORTED])
@pytest.mark.unit
def test_a_member_that_says_it_left_or_aborted_is_gone_at_once(storage, clock, final):
    hb = mb.heartbeat(layer(storage), A, INTERVAL)
    hb.announce(mb.ALIVE)
    w = watch(storage)
    assert w.alive(A)
    hb.stop(final)
    assert w.state(A) == final
    assert A in w.gone
    # the judgement outlives the HeartbeatWatch that made it (a later one of the same job)
    assert watch(storage).state(A) == "gone"


@pytest.mark.unit
def test_time_this_process_was_frozen_is_not_the_others_silence(storage, clock):
    hb = mb.heartbeat(layer(storage), A, INTERVAL)
    hb.announce(mb.ALIVE)
    w = watch(storage)
    run_for(clock, 2.0, lambda: w.state(A))
    clock.advance(10 * TIMEOUT)  # this process stopped: nobody ticked its clock
    assert w.alive(A), "a freeze of the watcher was taken for the member's silence"
    # after the resume the member's silence is counted again, from the resume
    run_for(clock, TIMEOUT - 1.0, lambda: w.state(A))
    assert w.alive(A)
    run_for(clock, 2.0, lambda: w.state(A))
    assert w.state(A) == "gone"


@pytest.mark.unit
def test_fresh_means_the_counter_was_seen_moving_less_than_a_beat_gap_ago(storage, clock):
    hb = mb.heartbeat(layer(storage), A, INTERVAL)
    hb.announce(mb.ALIVE)
    w = watch(storage)
    assert w.alive(A) and not w.fresh(A)  # a first look proves nothing about now
    clock.advance(INTERVAL)
    hb.announce(mb.ALIVE)
    assert w.alive(A) and w.fresh(A)
    clock.advance(INTERVAL)  # read again before its next beat: still running
    assert w.alive(A) and w.fresh(A) and not w.overdue(A)
    clock.advance(INTERVAL)  # two intervals without a beat: more than a freeze bound
    assert w.alive(A) and not w.fresh(A) and w.overdue(A)
    # a judgement can change when the silence reaches the timeout
    assert w.next_change() == pytest.approx(clock.now - 2 * INTERVAL + TIMEOUT, abs=0.01)
    clock.advance(10 * TIMEOUT)  # a read long after the previous one proves nothing
    hb.announce(mb.ALIVE)
    assert w.alive(A) and not w.fresh(A) and not w.overdue(A)


# -- HeartbeatWatch: hostile heartbeats --------------------------------------------------------

@pytest.mark.unit
def test_a_heartbeat_forged_without_the_job_key_is_refused(storage, clock):
    storage.objects[hb_key(A)] = encode_record({"id": A, "beat": 1, "state": "alive"}, None)
    with pytest.raises(ShardCorrupt, match="MAC mismatch") as info:
        watch(storage).state(A)
    assert info.value.path == storage.path_of(hb_key(A))


@pytest.mark.unit
def test_a_heartbeat_under_another_members_name_is_refused(storage, clock):
    storage.objects[hb_key(A)] = encode_record({"id": B, "beat": 1, "state": "alive"}, SECRET)
    with pytest.raises(ShardCorrupt, match=f"heartbeat record of member {A} is not one"):
        watch(storage).state(A)
    storage.objects[hb_key(A)] = encode_record({"id": A, "beat": 1, "state": "zombie"}, SECRET)
    with pytest.raises(ShardCorrupt, match="is not one"):
        watch(storage).state(A)


@pytest.mark.unit
def test_an_oversized_heartbeat_is_refused_unread(storage, clock):
    storage.objects[hb_key(A)] = b" " * (RECORD_LIMIT + 1)
    with pytest.raises(ShardCorrupt, match="refused unread"):
        watch(storage).state(A)


@pytest.mark.unit
def test_a_deeply_nested_heartbeat_gives_a_ferrosync_error_not_a_recursion_error(storage, clock):
    storage.objects[hb_key(A)] = encode_record({"id": A, "x": json.loads("[" * 100 + "]" * 100)},
                                               None)
    with pytest.raises(ShardCorrupt, match="nested"):
        watch(storage, secret=None).state(A)


# -- Roster records --------------------------------------------------------------------------

@pytest.mark.unit
def test_a_roster_round_trips_through_its_record():
    roster = mb.Roster(7, (A, B), (B, C), 3, 2)
    assert mb.Roster.from_record(roster.record(), 7, "p") == roster
    assert not roster.founding
    assert mb.Roster(8, (A,), (B, C), 3).founding  # nobody of the next round contributed


@pytest.mark.parametrize("bad", [
    {"round": 6},                                   # another round's roster
    {"members": [B, B]},                            # a member twice
    {"members": ["../../etc"]},                     # not a member id
    {"join_next": -1},
    {"changes": -2},
    {"contributors": 5},
    {"round": None},
])
@pytest.mark.unit
def test_a_malformed_roster_record_is_shard_corrupt(bad):
    record = {**mb.Roster(7, (A,), (A, B), 3).record(), **bad}
    with pytest.raises(ShardCorrupt, match="roster of round 7 is malformed"):
        mb.Roster.from_record(record, 7, "mem://test/r7.roster")
    with pytest.raises(ShardCorrupt):
        mb.Roster.from_record({k: v for k, v in record.items() if k != "members"}, 7, "p")


# -- Rosters: written once, read back, the window ---------------------------------------------

@pytest.mark.unit
def test_the_first_roster_written_wins_and_everyone_reads_it(storage):
    rosters = mb.Rosters(layer(storage, SECRET))
    mine = mb.Roster(0, (), (A, B), 2)
    theirs = mb.Roster(0, (), (B,), 1)
    assert rosters.read(0) is None
    assert rosters.create(mine) == mine
    assert mb.Rosters(layer(storage, SECRET)).create(theirs) == mine
    assert rosters.read(0) == mine
    assert rosters.latest_hint() == 0
    assert rosters.read(-1) == mb.EMPTY


@pytest.mark.unit
def test_a_roster_written_just_before_ours_is_read_back(storage):
    rosters = mb.Rosters(layer(storage, SECRET))
    theirs = mb.Roster(3, (A,), (A,), 0)
    storage.before("put", f"{NS}/{names.elastic_roster(3)}",
                   lambda key: mb.Rosters(layer(storage, SECRET)).create(theirs))
    assert rosters.create(mb.Roster(3, (A, B), (A, B), 0)) == theirs


@pytest.mark.unit
def test_a_roster_forged_without_the_job_key_is_refused(storage):
    mb.Rosters(layer(storage, None)).create(mb.Roster(0, (), (C,), 1))
    with pytest.raises(FerrosyncError, match="MAC mismatch") as info:
        mb.Rosters(layer(storage, SECRET)).read(0)
    assert info.value.path == storage.path_of(f"{NS}/{names.elastic_roster(0)}")


@pytest.mark.unit
def test_rosters_older_than_the_window_are_deleted(storage):
    rosters = mb.Rosters(layer(storage, SECRET))
    last = mb.ROSTER_RETENTION + 2
    for r in range(last + 1):
        rosters.create(mb.Roster(r, (A,), (A,), 0))
    kept = [r for r in range(last + 1) if rosters.read(r) is not None]
    assert kept == list(range(last - mb.ROSTER_RETENTION + 1, last + 1))
    assert rosters.latest_hint() == last


@pytest.mark.unit
def test_newest_probes_upward_from_a_stale_hint(storage):
    rosters = mb.Rosters(layer(storage, SECRET))
    for r in range(3):
        rosters.create(mb.Roster(r, (A,), (A,), 0))
    storage.objects[f"{NS}/latest"] = encode_record({"round": 0}, SECRET)  # a raced hint
    assert rosters.newest(deadline=1e18).round == 2


@pytest.mark.unit
def test_newest_times_out_when_the_hinted_roster_stays_missing(storage, clock):
    rosters = mb.Rosters(layer(storage, SECRET))
    storage.objects[f"{NS}/latest"] = encode_record({"round": 9}, SECRET)
    start = clock.now
    with pytest.raises(SyncTimeout, match="round 9 named by the 'latest' hint"):
        rosters.newest(deadline=start + 2.0)
    assert 2.0 < clock.now - start < 2.1


@pytest.mark.parametrize("value", ["7", True, None, 1.5])
@pytest.mark.unit
def test_a_hint_that_is_not_an_int_counts_as_none(storage, value):
    storage.objects[f"{NS}/latest"] = encode_record({"round": value}, SECRET)
    assert mb.Rosters(layer(storage, SECRET)).latest_hint() == -1


# -- join entries ---------------------------------------------------------------------------

@pytest.mark.unit
def test_joiners_claim_the_smallest_free_entries_in_order(storage):
    first = mb.Rosters(layer(storage, SECRET))
    second = mb.Rosters(layer(storage, SECRET))
    assert first.claim(A, 0, 1e18) == 0
    assert second.claim(B, 0, 1e18) == 1  # entry 0 taken: exclusive create, next one
    assert first.claim(C, 0, 1e18) == 2
    reader = mb.Rosters(layer(storage, SECRET))
    assert [reader.join_entry(n) for n in range(4)] == [A, B, C, None]
    assert record_at(storage, f"{NS}/{names.elastic_join(1)}") == {"id": B}


@pytest.mark.unit
def test_a_claim_finds_the_first_free_entry_in_logarithmic_requests(storage):
    """100,000 entries planted ahead of the queue (empty names): the claim gallops and
    bisects to the first free entry instead of trying every one."""
    for n in range(100_000):
        storage.objects[f"{NS}/{names.elastic_join(n)}"] = b""
    assert mb.Rosters(layer(storage)).claim(A, 0, 1e18) == 100_000
    assert len(storage.log) < 60, len(storage.log)


@pytest.mark.unit
def test_a_claim_that_keeps_losing_its_race_ends_at_the_deadline(storage, clock):
    def someone_else_first(key):  # every entry is taken just before this member's create
        storage.objects[key] = encode_record({"id": B}, SECRET)
        storage.before("put", f"{NS}/p??/join.*", someone_else_first)

    storage.before("put", f"{NS}/p??/join.*", someone_else_first)
    start = clock.now
    with pytest.raises(SyncTimeout, match="no free entry of the join queue"):
        mb.Rosters(layer(storage)).claim(A, 0, start + 2.0)
    assert clock.now - start < 2.1


@pytest.mark.unit
def test_a_join_entry_is_read_once_then_remembered(storage):
    rosters = mb.Rosters(layer(storage, SECRET))
    mb.Rosters(layer(storage, SECRET)).claim(A, 0, 1e18)
    before = len(storage.requests("open", f"{NS}/{names.elastic_join(0)}"))  # the claim's probe
    assert rosters.join_entry(0) == A
    assert rosters.join_entry(0) == A
    assert len(storage.requests("open", f"{NS}/{names.elastic_join(0)}")) == before + 1


@pytest.mark.parametrize("record", [{"id": "not-an-id"}, {"id": 5}, {}])
@pytest.mark.unit
def test_a_malformed_join_entry_is_shard_corrupt(storage, record):
    storage.objects[f"{NS}/{names.elastic_join(0)}"] = encode_record(record, SECRET)
    with pytest.raises(ShardCorrupt, match="join entry 0 is malformed"):
        mb.Rosters(layer(storage, SECRET)).join_entry(0)


@pytest.mark.unit
def test_a_join_entry_forged_without_the_job_key_is_refused(storage):
    mb.Rosters(layer(storage, None)).claim(A, 0, 1e18)
    with pytest.raises(ShardCorrupt, match="MAC mismatch"):
        mb.Rosters(layer(storage, SECRET)).join_entry(0)


# -- liveness settings -------------------------------------------------------------------

def test_liveness_defaults_depend_on_the_kind_of_store(tmp_path, s3_transport):
    """An elastic member beats every 10 s on an object store (every beat a billed PUT)
    and every second on a directory; a fixed-size job keeps the store's interval; an
    interval the user sets stretches the default timeout to 3 intervals, a timeout the
    user sets shrinks the default interval to a third of it; a timeout too short for
    an interval the user set is refused, naming both, and closes the storage."""
    from ferrosync.elastic.options import ElasticOptions
    from ferrosync.errors import ConfigError
    from ferrosync.storage.engines import open_storage
    from ferrosync.storage.options import StorageOptions

    def s3():
        return open_storage(s3_transport.url, s3_transport.options["storage_options"])

    def liveness(options_class, options, storage):
        try:
            t = options_class.parse(options).timing(storage)
        finally:
            storage.close()
        return t.heartbeat_interval, t.heartbeat_timeout

    assert liveness(ElasticOptions, {}, s3()) == (10.0, 30.0)
    assert liveness(ElasticOptions, {}, open_storage(str(tmp_path))) == (1.0, 20.0)
    assert liveness(StorageOptions, {}, s3()) == (2.0, 20.0)
    assert liveness(ElasticOptions, {"heartbeat_interval": 15}, s3()) == (15.0, 45.0)
    # a timeout the user chose: the default interval beats at least 3 times in it
    assert liveness(ElasticOptions, {"heartbeat_timeout": 45}, s3()) == (10.0, 45.0)
    assert liveness(ElasticOptions, {"heartbeat_timeout": 6}, s3()) == (2.0, 6.0)
    with pytest.raises(ConfigError, match=r"heartbeat_timeout \(5 s\) must exceed twice "
                                          r"the heartbeat interval \(10 s\)"):
        liveness(ElasticOptions, {"heartbeat_timeout": 5, "heartbeat_interval": 10}, s3())
