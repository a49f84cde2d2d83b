"""``ops/gc.py``'s plan and its application, in this process, over a ``MemoryStorage`` holding
what jobs leave behind (announcements, heartbeats, data, temp files) and a ``FakeClock``
for the watch window (tests/fakes.py).

Each decision is checked with its reason: finished and dead generations go, a live one
and a job's newest unfinished one stay, ``--keep`` keeps each job's newest finished
ones, a junk abort marker protects, an elastic namespace is never touched, a temp file
goes only when its writer is provably gone; heartbeats are deleted last; a dry run
deletes nothing. The real CLI on real jobs: tests/test_gc.py and tests/test_ops.py.
"""

from __future__ import annotations

import json

import pytest

from fakes import FakeClock, MemoryStorage
from ferrosync.ops import gc, watch
from ferrosync.ops.keys import JobKeys
from ferrosync.storage import names
from ferrosync.storage.wire import encode_record

WINDOW = 3.0  # three heartbeat periods of the store (MemoryStorage: 1 s)


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch, gc, watch)


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock)


def generation(storage, job, number, states=("closed", "closed"), *, pid=100):
    """Job ``job``'s generation ``number``: its announcement, a layout record, a
    contribution per rank and a heartbeat per rank in ``states`` (``None``: none); its
    directory."""
    token = f"{ord(job[0]):02x}{number:014x}"  # 16 hex digits, unique per (job, number)
    prefix = names.generation_dir(number, token)
    storage.put(names.within(names.namespace(job), names.announcement(number)),
                [encode_record({"token": token, "world_size": len(states)}, None)])
    # a layout record: its name lists after the heartbeats'
    storage.put(names.within(prefix, names.layout_record(bytes(8), 0)), [bytes(64)])
    for rank, state in enumerate(states):
        storage.put(names.within(prefix, names.contribution(1, rank)), [bytes(64)])
        if state is not None:
            beat(storage, prefix, rank, 1, state, pid=pid + rank)
    return prefix


def beat(storage, prefix, rank, count, state="running", pid=100):
    storage.put(names.within(prefix, names.heartbeat(rank)),
                [encode_record({"beat": count, "state": state, "pid": pid}, None)])


def plan(storage, keep=0, window=WINDOW):
    return {d.target: d for d in gc.plan(storage, JobKeys(), window, keep)}


def test_finished_and_dead_generations_go_a_live_one_stays(storage, clock):
    finished = generation(storage, "a", 0)
    dead = generation(storage, "a", 1, ("running", "running"))
    live = generation(storage, "a", 2, ("running", "running"))
    clock.call_later(0.5, lambda: (beat(storage, live, 0, 2), beat(storage, live, 1, 2)))
    decisions = plan(storage)
    assert decisions[finished].action == "remove"
    assert decisions[finished].reason == "finished: every rank closed or aborted"
    assert decisions[dead].action == "remove"
    assert decisions[dead].reason.startswith("dead: no heartbeat counter moved while watched "
                                             "(ranks [0, 1] stale)")
    assert (decisions[live].action, decisions[live].reason) == (
        "keep", "live: heartbeat counters are moving (ranks [0, 1])")
    assert sorted(decisions[finished].keys) == sorted(
        k for k in storage.objects if k.startswith(finished + "/"))


def test_a_jobs_newest_generation_goes_only_once_finished(storage):
    older = generation(storage, "a", 0, ("running", "running"))
    newest = generation(storage, "a", 1, ("running", "running"))  # e.g. a suspended job
    other = generation(storage, "b", 0)  # another job's newest, finished
    decisions = plan(storage)
    assert decisions[older].action == "remove"
    assert decisions[newest].action == "keep"
    assert "the newest generation of job a is removed only when finished" in (
        decisions[newest].reason)
    assert decisions[other].action == "remove"


def test_keep_keeps_each_jobs_newest_finished_generations(storage):
    a = [generation(storage, "a", n) for n in range(3)]
    b = [generation(storage, "b", n) for n in range(2)]
    decisions = plan(storage, keep=1)
    kept = {t for t, d in decisions.items() if d.action == "keep"}
    assert kept == {a[2], b[1]}
    assert decisions[a[2]].reason == "finished; kept by --keep 1"


def test_a_junk_abort_marker_protects_its_generation(storage):
    prefix = generation(storage, "a", 0, ("running", "running"))
    generation(storage, "a", 1)
    storage.put(names.within(prefix, names.abort(1)), [b"\x00 not a record"])
    decision = plan(storage)[prefix]
    assert decision.action == "keep"
    # rank 0 is stale, but what rank 1's marker says cannot be known: no proof of death
    assert decision.reason.startswith("cannot prove it finished or dead (rank 0 stale: ")
    assert "rank 1 untrusted: not a ferrosync control record" in decision.reason


def test_temp_files_go_only_when_their_writer_is_provably_gone(storage, clock):
    live = generation(storage, "a", 0, ("running", "running"), pid=500)
    clock.call_later(0.5, lambda: beat(storage, live, 0, 2, pid=500))
    mine = names.within(live, names.temp(names.contribution(2, 0), pid=500))
    orphan = names.within(live, names.temp(names.contribution(2, 1), pid=999))
    loose = names.temp("probe.r0", pid=998)
    for key in (mine, orphan, loose):
        storage.put(key, [bytes(10)])
    decisions = gc.plan(storage, JobKeys(), WINDOW, 0)
    by_keys = {tuple(d.keys): d for d in decisions if d.keys}
    assert by_keys[(mine,)].action == "keep"
    assert by_keys[(mine,)].reason == "their writer may still be running (pids [500])"
    assert by_keys[(orphan,)].action == "remove" and by_keys[(loose,)].action == "remove"
    assert by_keys[(orphan,)].reason == ("outlived the 3 s watch window and their writer is "
                                         "not running")
    # without a window nothing tells an orphan from a file being written
    decisions = gc.plan(storage, JobKeys(), 0.0, 0)
    assert all(d.action == "keep" for d in decisions if loose in d.keys)
    assert any("no watch window (--watch 0)" in d.reason for d in decisions)


def test_an_elastic_namespace_is_never_touched_and_is_named(storage):
    namespace = names.elastic_namespace("el-job")
    storage.put(names.within(namespace, names.ELASTIC_JOB_RECORD), [bytes(100)])
    storage.put(names.within(namespace, names.temp("m1", pid=999)), [bytes(20)])
    (decision,) = gc.plan(storage, JobKeys(), WINDOW, 0)
    assert (decision.target, decision.action, decision.keys) == (f"{namespace}/", "keep", [])
    assert "an elastic job (2 objects, 120 B, 1 temp files)" in decision.reason
    assert "it may be running" in decision.reason
    storage.put(names.within(namespace, names.ELASTIC_ENDED), [bytes(10)])
    (decision,) = gc.plan(storage, JobKeys(), WINDOW, 0)
    assert "it has ended (its end marker is there)" in decision.reason


def test_apply_deletes_heartbeats_last_and_keeps_the_rendezvous_records(storage):
    prefixes = [generation(storage, "a", n) for n in (0, 1)]
    sizes = {k: len(v) for k, v in storage.objects.items()}
    decisions = gc.plan(storage, JobKeys(), WINDOW, 0)
    assert gc.apply(storage, decisions) == (10, sum(
        size for k, size in sizes.items() if k.split("/")[0] in prefixes))
    for prefix in prefixes:
        deleted = storage.requests("delete", prefix + "/*")
        kinds = [names.parse(k.rpartition("/")[2]).kind for k in deleted]
        # a concurrent inspect never sees data without its liveness
        assert sorted(kinds[:3]) == ["contribution", "contribution", "layout"]
        assert kinds[3:] == ["heartbeat", "heartbeat"]
    assert sorted(storage.objects) == [
        names.within(names.namespace("a"), names.announcement(n)) for n in (0, 1)]


def test_a_dry_run_reports_and_deletes_nothing(storage, capsys):
    prefix = generation(storage, "a", 0)
    generation(storage, "a", 1, ("running", "running"))
    before = dict(storage.objects)
    assert gc.run(storage, JobKeys(), WINDOW, keep=0, dry_run=True, as_json=False) == 0
    text = capsys.readouterr().out
    assert storage.objects == before and storage.requests("delete") == []
    assert f"ferrosync gc {storage.url}  (dry run: nothing deleted)" in text
    assert f"would remove {prefix} (5 objects, " in text
    assert "would remove 5 objects" in text and "rdzv*/ records kept" in text
    assert gc.run(storage, JobKeys(), WINDOW, keep=0, dry_run=True, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] and report["removed_objects"] == 0
    assert {d["target"]: d["action"] for d in report["decisions"]}[prefix] == "remove"
