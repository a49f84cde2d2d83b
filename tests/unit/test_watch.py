"""``ops/watch.py``: liveness as the operator tools judge it, in this process.

Heartbeat records live in a ``MemoryStorage`` and time is a ``FakeClock`` (tests/fakes.py),
so "rank 1 beats again 0.3 s into the watch" is an action the clock runs inside the watch
loop. Checked: a moving counter is live and ends the watch early, a stuck one is stale only
after two heartbeat periods (the record's own period first), what cannot be trusted is
never judged stale, and a generation's status, progress and stragglers follow from the
ranks' views. The tools built on it (inspect, gc) run on real jobs in tests/test_ops.py.
"""

from __future__ import annotations

import types

import pytest

from fakes import FakeClock, MemoryStorage
from ferrosync.ops import watch
from ferrosync.ops.scan import FoundGeneration, Obj, Record, read_record
from ferrosync.ops.watch import (
    Observation,
    RankView,
    generation_status,
    judge,
    observe,
    progress,
    stragglers,
)
from ferrosync.storage import names
from ferrosync.storage.wire import encode_record

PREFIX = names.generation_dir(4, "0123456789abcdef")
POLL = 0.1


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch, watch)


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock)


def _hb(rank):
    return names.within(PREFIX, names.heartbeat(rank))


def _beat(storage, rank, beat, state="running", **extra):
    storage.put(_hb(rank), [encode_record({"beat": beat, "state": state, **extra}, None)])


def _record(body, trust="plain", problem=None):
    return Record("k", body, trust, problem)


# -- watching heartbeats ------------------------------------------------------------------------

def test_a_moving_counter_ends_the_watch_early_with_a_fresh_last_read(storage, clock):
    _beat(storage, 0, 1)
    first = {_hb(0): read_record(storage, _hb(0), None)}
    clock.call_later(0.25, lambda: _beat(storage, 0, 2))
    clock.call_later(0.55, lambda: _beat(storage, 0, 3, collective=9))
    begun = clock.now
    (seen,) = observe(storage, first, 10.0, {_hb(0): None}, POLL).values()
    assert seen.changed and seen.first.get("beat") == 1
    assert 0.25 <= clock.now - begun <= 0.25 + POLL + 1e-9  # not the whole 10 s
    assert seen.last.get("beat") == 2 and seen.watched_s == pytest.approx(clock.now - begun)


def test_a_stuck_counter_is_watched_for_the_whole_window(storage, clock):
    _beat(storage, 0, 7)
    first = {_hb(0): read_record(storage, _hb(0), None), _hb(1): None}
    clock.call_later(1.0, lambda: _beat(storage, 1, 0))  # a rank that starts late
    seen = observe(storage, first, 3.0, {_hb(0): None, _hb(1): None}, POLL)
    assert not seen[_hb(0)].changed and seen[_hb(0)].watched_s == pytest.approx(3.0)
    assert seen[_hb(1)].changed and seen[_hb(1)].first is None  # missing, then there


def test_a_rank_that_closed_is_not_watched(storage, clock):
    _beat(storage, 0, 5, state="closed")
    first = {_hb(0): read_record(storage, _hb(0), None)}
    reads = len(storage.requests("open"))
    (seen,) = observe(storage, first, 3.0, {_hb(0): None}, POLL).values()
    assert not seen.changed and len(storage.requests("open")) == reads
    assert clock.slept == 0.0


# -- one rank's view ----------------------------------------------------------------------------

def _view(last=None, *, changed=False, watched=3.0, abort=None, interval=1.0):
    obs = Observation(last, last, changed, watched) if last is not None else None
    return watch._rank_view(1, obs, abort, interval)


@pytest.mark.parametrize("case, state, problem", [
    ({"last": {"beat": 3, "state": "running"}, "changed": True}, "live", None),
    ({"last": {"beat": 3, "state": "closed"}}, "closed", None),
    ({"last": {"beat": 3, "state": "running"}}, "stale", "heartbeat stuck at 3 for 3.0 s"),
    ({"last": {"beat": 3, "state": "running"}, "watched": 1.5}, "unjudged",
     "watched 1.5 s, under two heartbeat periods (1 s each): use a longer --watch"),
    # the record's own period outweighs the store's default
    ({"last": {"beat": 3, "state": "running", "interval": 2.0}}, "unjudged",
     "(2 s each)"),
    ({"last": {"beat": 3, "state": "running", "interval": -1}}, "stale", "stuck at 3"),
    ({}, "missing", None),
    ({"abort": {"type": "ValueError"}}, "aborted", None),
])
def test_a_ranks_state_from_its_heartbeat_and_abort_marker(case, state, problem):
    case = dict(case)
    last = case.pop("last", None)
    abort = case.pop("abort", None)
    view = _view(_record(last) if last is not None else None,
                 abort=_record(abort) if abort is not None else None, **case)
    assert view.state == state
    if problem is None:
        assert view.problem is None
    else:
        assert problem in view.problem


def test_what_cannot_be_trusted_is_never_judged_stale():
    forged = _record({"beat": 3, "state": "running"}, "forged", "MAC does not match")
    assert (_view(forged).state, _view(forged).problem) == ("untrusted", "MAC does not match")
    junk_abort = _record(None, "bad", "not a ferrosync control record")
    view = _view(_record({"beat": 3, "state": "running"}), abort=junk_abort)
    assert (view.state, view.problem) == ("untrusted", "not a ferrosync control record")


# -- a generation ----------------------------------------------------------------------------------

def _gen(announced=True, objects=True):
    gen = FoundGeneration(4, "0123456789abcdef",
                          announcement=_record({"world_size": 2}) if announced else None)
    if objects:
        gen.objects.append(Obj(names.within(PREFIX, "c1.r0"), 10, "contribution", rank=0))
    return gen


def _views(*states):
    return [RankView(r, s, None, None) for r, s in enumerate(states)]


NOT_ANNOUNCED = types.SimpleNamespace(may_be_announced=lambda gen: False)


@pytest.mark.parametrize("gen, states, status", [
    (_gen(), ("live", "stale"), "live"),
    (_gen(), ("closed", "aborted"), "finished"),
    (_gen(), ("stale", "missing"), "dead"),
    (_gen(), ("stale", "closed"), "dead"),
    (_gen(), ("stale", "unjudged"), "unknown"),
    (_gen(), ("stale", "untrusted"), "unknown"),
    (_gen(), ("missing", "missing"), "unknown"),
    (_gen(objects=False), ("missing",), "empty"),
    (_gen(announced=False, objects=False), (), "orphan"),
    (_gen(announced=False), ("closed", "closed"), "finished"),  # its announcement is gone
])
def test_a_generations_status_follows_from_its_ranks(gen, states, status):
    assert generation_status(gen, _views(*states), NOT_ANNOUNCED) == status


def test_an_unannounced_directory_a_job_may_still_announce_is_being_created():
    maybe = types.SimpleNamespace(may_be_announced=lambda gen: True)
    assert generation_status(_gen(announced=False, objects=False), [], maybe) == "creating"


def _live(rank, first, last, watched=2.0):
    obs = Observation(_record({"collective": first}), _record({"collective": last}), True,
                      watched)
    return RankView(rank, "live", obs, None)


def test_a_stalled_leader_names_the_live_ranks_behind_it():
    views = [_live(0, 9, 9), _live(1, 8, 8), _live(2, 9, 9), RankView(3, "stale", None, None)]
    assert progress(views) == {"from": 9, "to": 9, "seconds": 2.0, "stalled": True}
    assert stragglers(views) == [1]
    moving = [_live(0, 9, 12), _live(1, 8, 11)]  # one behind is normal while moving
    assert progress(moving)["stalled"] is False and stragglers(moving) == []
    assert progress([RankView(0, "closed", None, None)]) is None


def test_judge_watches_every_rank_of_the_world_once(storage, clock):
    gen = _gen()
    _beat(storage, 0, 1)
    gen.objects.append(Obj(_hb(0), 50, "heartbeat", rank=0))
    clock.call_later(0.2, lambda: _beat(storage, 0, 2))
    keys = types.SimpleNamespace(secret=lambda namespace: None)
    (views,) = judge(storage, [gen], keys, 1.0).values()
    # rank 1 never wrote a heartbeat: missing, and reported
    assert [(v.rank, v.state) for v in views] == [(0, "live"), (1, "missing")]
    single = FoundGeneration(5, "fedcba9876543210", announcement=_record({"world_size": 1}))
    (views,) = judge(storage, [single], keys, 1.0).values()
    assert views[0].problem == "a world of one writes no heartbeats: liveness unknown"
