"""``ferrosync.elastic.rounds`` in one process: sized reads and agreeing on a roster.

One member's ``Agreement`` waits over a ``MemoryStorage`` on a ``FakeClock``
(tests/fakes.py); the other members are objects and actions the clock runs inside
that wait ("member B writes the roster 0.5 s later", "member C's heartbeat stops"),
so no test depends on which of two threads runs first, and every timeout is reached
at a known fake instant in milliseconds. The one process clock of the liveness rule
(``liveness.PROCESS_CLOCK``) ticks on the fake clock too. The same protocol across
real processes: tests/test_elastic.py.
"""

from __future__ import annotations

import pytest

from fakes import MemoryStorage, install_elastic_clock
from ferrosync.elastic import membership as mb
from ferrosync.elastic import rounds
from ferrosync.errors import MemberDropped, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage import objects as objects_module
from ferrosync.storage.objects import Objects
from ferrosync.storage.wire import job_key, job_tag
from ferrosync.testing.sim.scheduler import Process, Scheduler
from ferrosync.testing.sim.store import PROFILES, SimServer, SimStorage

pytestmark = pytest.mark.unit

NS = names.elastic_namespace("unit")
SECRET = job_key(b"team secret", NS)
INTERVAL = 0.5
TIMEOUT = 5.0
CHECK = 1.0
POLL = (0.01, 0.1)
A, B, C, D = "a" * 16, "b" * 16, "c" * 16, "d" * 16


@pytest.fixture
def clock(monkeypatch):
    return install_elastic_clock(monkeypatch, rounds, objects_module)


def layer(storage, secret=SECRET):
    """The job's object layer over ``storage`` (what a member builds at connect)."""
    return Objects(storage, NS, key=secret, tag=job_tag(NS), poll=POLL)


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock, latency=0.001)


class Member:
    """One member's view: its rosters, its watch, its agreement."""

    def __init__(self, storage, *, min_ranks=1, max_ranks=None, check=CHECK):
        self.storage = storage
        self.rosters = mb.Rosters(layer(storage, SECRET))
        self.watch = mb.HeartbeatWatch(layer(storage, SECRET), TIMEOUT, INTERVAL)
        self.agreement = rounds.Agreement(layer(storage), self.rosters, self.watch,
                                          min_ranks=min_ranks, max_ranks=max_ranks,
                                          check_interval=check)


def beating(storage, clock, member, *, until=float("inf")):
    """``member``'s heartbeat, beating every interval on the fake clock until ``until``."""
    hb = mb.heartbeat(layer(storage), member, INTERVAL)

    def beat():
        hb.announce(mb.ALIVE)
        if clock.now + INTERVAL < until:
            clock.call_later(INTERVAL, beat)

    beat()
    return hb


def contribute(storage, round_, member, data=b"x" * 8):
    storage.objects[names.within(NS, names.elastic_contribution(round_, member))] = data


# -- waiting for the roster --------------------------------------------------------------------

def test_a_member_waits_for_the_roster_the_checker_writes(storage, clock):
    me, checker = Member(storage), Member(storage)
    beating(storage, clock, A)
    prev = mb.Roster(0, (), (A, B), 0)
    winner = mb.Roster(1, (A, B), (A, B), 0)
    clock.call_later(0.5, lambda: checker.rosters.create(winner))
    start = clock.now
    got = me.agreement.wait(1, prev, [A], deadline=start + 30.0)
    assert got == winner
    assert 0.5 <= clock.now - start < 0.5 + POLL[1] + 0.01
    # the waiter wrote nothing
    assert not storage.requests("put", f"{NS}/{names.elastic_roster(1)}")[1:]


def test_waiting_for_a_roster_times_out_at_the_deadline_naming_what_it_waits_on(storage, clock):
    me = Member(storage)
    beating(storage, clock, A)  # the checker is alive but never writes
    start = clock.now
    with pytest.raises(SyncTimeout, match="round 1 was not agreed in time; waiting on the "
                       "checker") as info:
        me.agreement.wait(1, mb.Roster(0, (), (A, B), 0), [A], deadline=start + 10.0)
    assert 10.0 <= clock.now - start < 10.0 + POLL[1] + 0.01
    assert info.value.collective == 1
    assert info.value.path == storage.path_of(f"{NS}/{names.elastic_roster(1)}")
    assert storage.objects.get(f"{NS}/{names.elastic_roster(1)}") is None


def test_the_checker_writes_the_roster_once_everyone_contributed(storage, clock):
    me = Member(storage)
    beating(storage, clock, B)
    contribute(storage, 1, A)
    clock.call_later(0.7, lambda: contribute(storage, 1, B))
    start = clock.now
    roster = me.agreement.wait(1, mb.Roster(0, (), (A, B), 0), [], deadline=start + 30.0)
    assert roster == mb.Roster(1, (A, B), (A, B), 0, 0)
    assert clock.now - start >= 0.7  # not before B contributed
    assert Member(storage).rosters.read(1) == roster  # written, sealed, readable
    assert Member(storage).rosters.latest_hint() == 1


def test_the_checker_reads_back_a_roster_another_member_wrote_first(storage, clock):
    me = Member(storage)
    contribute(storage, 1, A)
    theirs = mb.Roster(1, (A,), (A, C), 0)
    storage.before("put", f"{NS}/{names.elastic_roster(1)}",
                   lambda key: Member(storage).rosters.create(theirs))
    roster = me.agreement.wait(1, mb.Roster(0, (), (A,), 0), [], deadline=clock.now + 30.0)
    assert roster == theirs


def test_a_member_becomes_the_checker_when_its_predecessor_leaves(storage, clock):
    me = Member(storage)
    hb_a = beating(storage, clock, A, until=clock.now + 2.0)
    contribute(storage, 1, B)
    clock.call_later(2.0, lambda: hb_a.stop(mb.LEFT))
    start = clock.now
    roster = me.agreement.wait(1, mb.Roster(0, (), (A, B), 0), [A], deadline=start + 30.0)
    assert roster.contributors == (B,) and roster.members == (B,)
    assert roster.changes == 1
    # a graceful leave is seen at the next look, not after the heartbeat timeout
    assert clock.now - start < 2.0 + CHECK + 0.2


def test_a_silent_member_is_dropped_after_the_timeout_not_before(storage, clock):
    me = Member(storage)
    contribute(storage, 1, A)
    beating(storage, clock, B, until=clock.now + 1.0)  # B's beats stop after 1 s
    beating(storage, clock, C)
    contribute(storage, 1, C)
    start = clock.now
    roster = me.agreement.wait(1, mb.Roster(0, (), (A, B, C), 0), [], deadline=start + 60.0)
    assert roster.contributors == (A, C) and roster.members == (A, C)
    assert TIMEOUT < clock.now - start < 1.0 + TIMEOUT + CHECK + 0.5


def test_a_contributor_judged_gone_counts_in_its_round_but_not_the_next(storage, clock):
    me = Member(storage)
    hb_c = beating(storage, clock, C, until=clock.now + 0.1)
    contribute(storage, 1, C)
    hb_c.stop(mb.ABORTED)  # C contributed, then failed
    contribute(storage, 1, A)
    # A's predecessor C: A looks at C (gone), so A checks and knows C is gone
    roster = me.agreement.wait(1, mb.Roster(0, (), (C, A), 0), [C], deadline=clock.now + 30.0)
    assert roster.contributors == (C, A)  # C's contribution is in round 1's sum
    assert roster.members == (A,)  # but C is not in round 2
    assert roster.changes == 1


def test_the_checker_waits_for_min_ranks_and_admits_joiners_in_queue_order(storage, clock):
    me = Member(storage, min_ranks=3, max_ranks=3)
    contribute(storage, 1, A)
    joiners = Member(storage)
    for who in (B, C, D):
        beating(storage, clock, who)
    clock.call_later(1.0, lambda: joiners.rosters.claim(B, 0, 1e18))
    clock.call_later(2.0, lambda: (joiners.rosters.claim(C, 0, 1e18),
                                   joiners.rosters.claim(D, 0, 1e18)))
    start = clock.now
    roster = me.agreement.wait(1, mb.Roster(0, (), (A,), 0), [], deadline=start + 30.0)
    assert roster.members == (A, B, C)  # max_ranks=3: D waits for a later round
    assert roster.join_next == 2
    assert 2.0 <= clock.now - start < 2.0 + POLL[1] + 0.05


@pytest.mark.unit
def test_a_wait_below_min_ranks_says_how_many_members_are_there(storage, clock, caplog):
    """The checker of a job being founded says how many members it has and needs, when
    it starts waiting and every 30 s after (the trainer shows these lines)."""
    me = Member(storage, min_ranks=2)
    beating(storage, clock, A)
    me.rosters.claim(A, 0, 1e18)
    caplog.set_level("INFO", logger="ferrosync.elastic")
    start = clock.now
    with pytest.raises(SyncTimeout, match="fewer than min_ranks=2"):
        me.agreement.wait(0, mb.EMPTY, [], deadline=start + 65.0, queued=1)
    lines = [r for r in caplog.records if r.name == "ferrosync.elastic"]
    assert [r.getMessage() for r in lines] == [
        "waiting for members: 1 here, 2 needed (min_ranks=2)"] * 3  # at 0, 30 and 60 s
    assert all(r.levelname == "INFO" for r in lines)


@pytest.mark.unit
def test_a_joiner_of_a_job_being_founded_says_how_many_are_queued(storage, clock, caplog):
    me = Member(storage, min_ranks=3)
    beating(storage, clock, A)  # the checker: alive, but waiting for a third member
    caplog.set_level("INFO", logger="ferrosync.elastic")
    with pytest.raises(SyncTimeout):
        me.agreement.wait(0, mb.EMPTY, [A], deadline=clock.now + 10.0, queued=2)
    assert [r.getMessage() for r in caplog.records if r.name == "ferrosync.elastic"] == [
        "waiting for members: 2 here, 3 needed (min_ranks=3)"]


def test_a_joiner_that_left_before_admission_is_skipped_and_its_entry_consumed(storage, clock):
    me = Member(storage)
    contribute(storage, 1, A)
    joiners = Member(storage)
    hb_b = beating(storage, clock, B, until=clock.now + 0.1)
    joiners.rosters.claim(B, 0, 1e18)
    hb_b.stop(mb.LEFT)
    beating(storage, clock, C)
    joiners.rosters.claim(C, 0, 1e18)
    roster = me.agreement.wait(1, mb.Roster(0, (), (A,), 0), [], deadline=clock.now + 30.0)
    assert roster.members == (A, C) and roster.join_next == 2


def test_a_member_too_far_behind_learns_it_was_dropped(storage, clock):
    me = Member(storage)
    others = Member(storage)
    beating(storage, clock, A)  # the checker of the others' rounds, alive and busy
    for r in range(3, 3 + mb.ROSTER_RETENTION + 2):  # the others went on without us
        others.rosters.create(mb.Roster(r, (A,), (A,), 0))
    assert others.rosters.read(3) is None  # round 3's roster already pruned
    start = clock.now
    with pytest.raises(MemberDropped, match="fell more than 64 rounds behind") as info:
        me.agreement.wait(3, mb.Roster(2, (A, B), (A, B), 0), [A], deadline=start + 60.0)
    # found out within a few check intervals, not at the deadline
    assert clock.now - start <= rounds.PRUNED_CHECK_EVERY * CHECK + 0.5
    assert info.value.collective == 3


# -- contributed / take on an object store -----------------------------------------------------

def test_on_an_object_store_the_checker_keeps_the_bytes_it_fetched(storage, clock):
    storage.round_trips_dominate = True
    me = Member(storage)
    contribute(storage, 1, A, b"a" * 8)
    contribute(storage, 1, B, b"b" * 8)
    roster = me.agreement.wait(1, mb.Roster(0, (), (A, B), 0), [], deadline=clock.now + 30.0,
                               sizes=(8,))
    assert roster.members == (A, B)
    assert me.agreement.take(1, B) == b"b" * 8
    assert me.agreement.take(1, B) is None  # handed over once
    assert me.agreement.take(1, C) is None


def test_a_contribution_of_the_wrong_size_is_not_kept_but_counts_as_present(storage, clock):
    storage.round_trips_dominate = True
    me = Member(storage)
    me.agreement.sizes = (8,)
    contribute(storage, 1, A, b"forged")
    assert me.agreement.contributed(1, A)  # the reduce reads it again and says why
    assert me.agreement.take(1, A) is None


# -- the checker's reads on a simulated S3 (virtual time, deterministic) ------------------------

class CountingStorage(SimStorage):
    """The simulator's S3 client, noting when each read of a contribution to round 1
    (``reads``) or of a heartbeat (``beats``) began and ended (virtual seconds)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.reads: list[tuple[str, float, float]] = []
        self.beats: list[tuple[str, float, float]] = []

    def open(self, key, **kwargs):
        start = self.server.sched.now
        try:
            return super().open(key, **kwargs)
        finally:
            if "/hb." in key:
                self.beats.append((key, start, self.server.sched.now))
            elif not key.endswith("roster") and "/r1." in key:
                self.reads.append((key, start, self.server.sched.now))


def on_simulated_s3(present, *, members=200, passes=(False,), run=None):
    """The checker of round 1 over a simulated S3 (the seed's latencies, faults and
    rates), with the contributions of ``present`` (indices into the roster, 8 bytes
    each) written; runs ``complete`` once per entry of ``passes`` (full or not), or
    ``run(agreement, ids)``, and returns (their results, the agreement, the storage,
    the roster's ids)."""
    sched = Scheduler()
    process = Process(sched, "checker", 0)
    storage = CountingStorage(SimServer(sched, PROFILES["s3"], 0), process)
    objects = Objects(storage, NS, key=SECRET, tag=job_tag(NS), poll=POLL,
                      runtime=process.runtime)
    ids = [f"{k:016x}" for k in range(members)]
    for k in present:
        key = objects.key_of(names.elastic_contribution(1, ids[k]))
        storage.server.objects[key] = bytes([k % 256]) * 8
    agreement = rounds.Agreement(objects, mb.Rosters(objects),
                                 mb.HeartbeatWatch(objects, TIMEOUT, INTERVAL),
                                 min_ranks=1, max_ranks=None, check_interval=CHECK)
    agreement.sizes = (8,)
    prev, got = mb.Roster(0, (), tuple(ids), 0), []
    sched.spawn(process, "checker", lambda: got.extend(
        [run(agreement, ids)] if run else (agreement.complete(prev, 1, f) for f in passes)))
    sched.run(sched.now + 600.0)
    assert not sched.failures, sched.failures
    return got, agreement, storage, ids


def in_flight(reads) -> int:
    """The most reads in flight at one virtual instant."""
    edges = sorted([(start, 1) for _, start, _ in reads] + [(stop, -1) for _, _, stop in reads],
                   key=lambda e: (e[0], e[1]))  # one that ends as another begins: apart
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_the_checker_reads_the_contributions_concurrently_not_one_after_the_other():
    members = 200
    (roster,), agreement, storage, ids = on_simulated_s3(range(members), members=members)
    assert roster.members == tuple(ids)
    keys = [key for key, _, _ in storage.reads]
    assert len(keys) == len(set(keys)) == members  # every contribution read once
    # one after the other (the reads' time summed) this took 200 round trips of ~20 ms;
    # now windows of 8 and 64, then the 128 left, 64 at a time
    assert in_flight(storage.reads) == rounds.READ_WIDTH
    took = max(stop for _, _, stop in storage.reads) - min(s for _, s, _ in storage.reads)
    assert took < sum(stop - start for _, start, stop in storage.reads) / 10
    for k, member in enumerate(ids):  # every byte fetched was kept for the reduce
        assert agreement.take(1, member) == bytes([k % 256]) * 8


def test_concurrent_reads_keep_no_more_than_the_budget_nor_hold_more_in_flight(monkeypatch):
    monkeypatch.setattr(rounds, "KEEP_BUDGET", 10 * 8)  # ten 8-byte contributions
    (roster,), agreement, storage, ids = on_simulated_s3(range(100), members=100)
    assert len(roster.members) == 100
    assert in_flight(storage.reads) == 10  # the bytes in flight fit the budget too
    kept = [agreement.take(1, member) for member in ids]
    assert sum(raw is not None for raw in kept) == 10  # the budget filled, no further
    assert all(raw == bytes([k]) * 8 for k, raw in enumerate(kept) if raw is not None)


def test_a_look_that_proves_no_member_running_reads_their_heartbeats_concurrently():
    # no heartbeat was ever written: every member is alive (not yet past the timeout)
    # but none is running now, so a look reads every member's heartbeat
    me = 50

    def look(agreement, ids):
        return agreement.is_checker(ids[:me], after=ids[me + 1:])

    (checker,), _, storage, ids = on_simulated_s3((), run=look)
    assert checker is False
    read = [key.rsplit(".", 1)[1] for key, _, _ in storage.beats]
    assert sorted(read) == sorted(ids[:me] + ids[me + 1:])  # each one once
    # one after the other this was 199 round trips; now windows of 2, 16 and 32
    # predecessors, then the 149 after it at once, 64 at a time
    assert in_flight(storage.beats) == rounds.READ_WIDTH


def test_a_cheap_pass_reads_a_window_at_a_time_and_nothing_twice():
    first, growth = rounds.FIRST_WINDOW, rounds.WINDOW_GROWTH
    gap = first + 3  # the first member that has not contributed (alive: no beat missed)
    present = [k for k in range(200) if k != gap]
    got, _, storage, ids = on_simulated_s3(present, passes=(False, False))
    assert got == [None, None]
    keys = [key for key, _, _ in storage.reads]
    # the first window was all there, the second held the gap: the pass stopped there
    one = first + first * growth
    assert len(set(keys[:one])) == one
    assert len(keys) == one + first
    # the next poll starts at the gap, and reads no contribution it saw present
    again = {key.rsplit(".", 1)[1] for key in keys[one:]}
    assert again == {ids[gap], *ids[one:one + first - 1]}


# -- who checks ----------------------------------------------------------------------------------

def test_is_checker_stops_at_the_first_predecessor_seen_running_now(storage, clock):
    me = Member(storage)
    for who in (A, B, C, D):
        beating(storage, clock, who)

    def reads(who):
        return len(storage.requests("open", f"{NS}/{names.elastic_heartbeat(who)}"))

    # a first look proves nothing about now: the look goes on to every predecessor (their
    # clocks start), and to the members after this one (it may be the checker soon)
    assert not me.agreement.is_checker([A, B, C], after=[D])
    assert [reads(w) for w in (A, B, C, D)] == [1, 1, 1, 1]
    clock.advance(INTERVAL)
    # A's counter moved since a recent look: A runs now; the look still reads the next
    # in line (B: when both die, this member has both clocks running), not C nor D
    assert not me.agreement.is_checker([A, B, C], after=[D])
    assert [reads(w) for w in (A, B, C, D)] == [2, 2, 1, 1]
    # a roster small enough to be read whole is read whole, every time
    assert not me.agreement.is_checker([A, B, C], after=[D], everyone=True)
    assert [reads(w) for w in (A, B, C, D)] == [3, 3, 2, 2]


def test_is_checker_when_every_predecessor_is_gone(storage, clock):
    me = Member(storage)
    for who in (A, B):
        beating(storage, clock, who, until=clock.now + 0.1).stop(mb.LEFT)
    assert me.agreement.is_checker([A, B])
    assert me.agreement.is_checker([])


def test_a_refusal_takes_back_the_admission_it_refuses_and_nothing_else():
    steady = mb.Roster(4, (A, B), (A, B), 0, 3)
    admitted = mb.Roster(5, (A, B), (A, B, C), 1, 4, admitted_only=True)
    assert admitted.newcomers == {C}
    # C's first contribution does not fit: the job is back to A, B and to 3 changes
    refused = mb.Roster(6, (A, B), (A, B), 1, refused=(C,))
    assert refused.changes_after(admitted) == 3
    # ... unless something else changed in that round too (B left): that one counts
    both = mb.Roster(6, (A, B), (A,), 1, refused=(C,))
    assert both.changes_after(admitted) == 4
    # an admission that came with a departure stays counted (the departure was real)
    mixed = mb.Roster(5, (A,), (A, C), 1, 4)
    assert mb.Roster(6, (A,), (A,), 1, refused=(C,)).changes_after(mixed) == 4
    assert mb.Roster(5, (A, B), (A, B), 0).changes_after(steady) == 3
    # round trip through the record, fields included
    again = mb.Roster.from_record(refused.record(), 6, "x")
    assert again == refused and mb.Roster.from_record(admitted.record(), 5, "x") == admitted


# -- members that die together ----------------------------------------------------------------

E, F = "e" * 16, "f" * 16


@pytest.mark.unit
@pytest.mark.parametrize("members, victims, contributed", [
    ((A, B, C, D), (A, D), False),  # the checker and the last
    ((A, B, C, D), (A, C), False),  # the checker and one behind the next in line
    ((A, B, C, D), (A, B), False),  # the checker and the next in line
    ((A, B, C, D), (B, D), False),  # two behind a checker that lives
    ((A, B, C, D, E, F), (A, F), True),  # a tree-sized roster; they contributed first
], ids=["checker+last", "checker+third", "checker+next", "second+last", "tree-contributed"])
def test_members_that_die_together_leave_within_one_and_a_half_timeouts(
        storage, clock, members, victims, contributed):
    """Victims stop beating at the same instant, after a healthy second of the round's
    wait; the first survivor (the one that writes the roster) must drop all of them
    within 1.5 heartbeat timeouts of the kill, whichever they are: every victim's
    silence clock starts near the kill, not once the one before it was judged."""
    me = next(m for m in members if m not in victims)
    mine = Member(storage)
    start = clock.now
    kill = start + 1.0
    for who in members:
        if who != me:
            beating(storage, clock, who, until=kill if who in victims else float("inf"))
    for who in members:
        if who not in victims or contributed:
            contribute(storage, 1, who)
    prev = mb.Roster(0, (), members, 0)
    roster = mine.agreement.wait(1, prev, list(members[:members.index(me)]),
                                 deadline=start + 60.0)
    assert not set(victims) & set(roster.members)
    assert clock.now - kill <= 1.5 * TIMEOUT, clock.now - kill


# -- a queued joiner's looks and the checker's admissions (issue 43: O(1) per joiner) ------
def ids(tag, n):
    return [f"{tag}{i:015x}" for i in range(n)]


def test_a_queued_joiner_reads_two_heartbeats_a_look_however_long_the_queue(storage, clock):
    me = Member(storage)
    members, queue = ids("a", 6), ids("b", 10)
    for who in members + queue:
        beating(storage, clock, who)

    def reads(who):
        return len(storage.requests("open", f"{NS}/{names.elastic_heartbeat(who)}"))

    for look in range(1, 5):
        assert not me.agreement.is_checker(members, ahead=lambda: queue)
        # the first look trusts members it never read; later ones find them running
        assert [reads(w) for w in members] == [look, look, 0, 0, 0, 0]
        clock.advance(INTERVAL)
    assert not any(reads(w) for w in queue)  # a member lives: no joiner can be checker


def test_a_queued_joiner_reads_on_past_members_that_stay_still(storage, clock):
    me = Member(storage)
    members = ids("a", 5)
    for who in members:
        beating(storage, clock, who, until=clock.now + 0.1 if who in members[:2] else
                float("inf"))

    def reads(who):
        return len(storage.requests("open", f"{NS}/{names.elastic_heartbeat(who)}"))

    assert not me.agreement.is_checker(members, ahead=list)
    assert [reads(w) for w in members] == [1, 1, 0, 0, 0]
    clock.advance(INTERVAL)
    # the first two did not beat since: not running now, the job may be dying, and
    # the scan goes on, not trusting members it never read, until one is seen running
    assert not me.agreement.is_checker(members, ahead=list)
    assert [reads(w) for w in members] == [2, 2, 1, 1, 1]
    clock.advance(INTERVAL)
    assert not me.agreement.is_checker(members, ahead=list)
    assert [reads(w) for w in members] == [3, 3, 2, 1, 1]  # the third runs now: enough


def test_a_queued_joiner_reads_the_joiners_ahead_once_every_member_is_gone(storage, clock):
    me = Member(storage)
    members, queue = ids("a", 2), ids("b", 4)
    for who in members:
        beating(storage, clock, who, until=clock.now + 0.1).stop(mb.LEFT)
    for who in queue:
        beating(storage, clock, who)
    taken = []

    def ahead():
        # as Rosters.entries: each join entry read as the look gets to it
        for who in queue:
            taken.append(who)
            yield who

    assert not me.agreement.is_checker(members, ahead=ahead)
    assert [len(storage.requests("open", f"{NS}/{names.elastic_heartbeat(w)}"))
            for w in queue] == [1, 1, 0, 0]
    assert taken == queue[:2]  # and no join entry past where the look stopped


def test_a_joiner_drops_a_job_that_died_whole_within_one_and_a_half_timeouts(storage, clock):
    """Every member dies at once a second into the round; the joiner first in the
    queue, which read two of them on its first look, restarts the job with a roster
    that drops them all within 1.5 heartbeat timeouts of the deaths."""
    joiner = Member(storage, check=INTERVAL)
    members = tuple(ids("a", 8))
    start = clock.now
    kill = start + 1.0
    for who in members:
        beating(storage, clock, who, until=kill)
    me = ids("c", 1)[0]
    beating(storage, clock, me)
    entry = joiner.rosters.claim(me, 0, 1e18)
    prev = mb.Roster(0, (), members, entry)
    roster = joiner.agreement.wait(1, prev, list(members), deadline=start + 60.0, queued=9,
                                     ahead=list)
    assert roster.members == (me,)
    assert clock.now - kill <= 1.5 * TIMEOUT, clock.now - kill


def test_the_checker_admits_a_long_queue_in_order_reading_it_in_batches(storage, clock):
    me = Member(storage, max_ranks=31)
    contribute(storage, 1, A)
    queue = ids("b", 3 * rounds.JOIN_READS)
    joiners = Member(storage)
    for k, who in enumerate(queue):
        hb = beating(storage, clock, who, until=clock.now + 0.01)
        if k == 5:
            hb.stop(mb.LEFT)  # skipped, its entry consumed
        joiners.rosters.claim(who, 0, 1e18)
    before = [len(storage.requests("open", f"{NS}/{names.elastic_join(n)}"))
              for n in range(len(queue))]
    roster = me.agreement.wait(1, mb.Roster(0, (), (A,), 0), [], deadline=clock.now + 30.0)
    admitted = [w for k, w in enumerate(queue) if k != 5][:30]
    assert roster.members == (A, *admitted)  # max_ranks: the rest wait
    assert roster.join_next == 31  # the 30 admitted and the one that left
    # batches of 1, 2, 4, 8, 16 entries: each read once, none past the room's
    entries = [len(storage.requests("open", f"{NS}/{names.elastic_join(n)}")) -
               before[n] for n in range(len(queue))]
    assert entries == [1] * 31 + [0] * 17
