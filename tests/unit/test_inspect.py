"""``ops/inspect.py``'s report and its text, in this process, over a ``MemoryStorage`` holding
what jobs leave behind and a ``FakeClock`` for the watch (tests/fakes.py).

The report says who is alive, who waits for whom, who failed and how, what each job's
claims and objects are and what its requests cost; the text escapes every name read from
storage, so a planted key cannot forge a line. The CLI on real jobs: tests/test_ops.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from fakes import FakeClock, MemoryStorage
from ferrosync.ops import inspect, watch
from ferrosync.ops.keys import JobKeys
from ferrosync.storage import names
from ferrosync.storage.wire import (
    DTYPE_CODES,
    KIND_CONTRIB,
    KIND_NAMES,
    Header,
    encode_record,
    layout_digest,
    seal,
)

TOKEN_A, TOKEN_B = "a" * 16, "b" * 16
GEN_A, GEN_B = names.generation_dir(3, TOKEN_A), names.generation_dir(0, TOKEN_B)


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch, watch)


@pytest.fixture
def storage(clock):
    return MemoryStorage(clock=clock)


def record(storage, key, body, secret=None):
    storage.put(key, [encode_record(body, secret)])


def announce(storage, job, number, token, world=2, **extra):
    record(storage, names.within(names.namespace(job), names.announcement(number)),
           {"token": token, "world_size": world, "host": "node1", "pid": 42, **extra})


def heartbeat(storage, prefix, rank, beat, collective, state="running", **extra):
    record(storage, names.within(prefix, names.heartbeat(rank)),
           {"beat": beat, "state": state, "collective": collective, "op": "average",
            "host": f"node{rank}", "pid": 100 + rank, **extra})


def contribution(storage, prefix, seq, rank, count=4):
    payload = torch.zeros(count).numpy().tobytes()
    header = Header(kind=KIND_CONTRIB, dtype=DTYPE_CODES[torch.float32], codec=0, rank=rank,
                    world_size=2, generation=1, collective=seq, count=count, offset=0,
                    total=count, weight=2.0, layout=layout_digest("x"),
                    payload_nbytes=len(payload))
    key = names.within(prefix, names.contribution(seq, rank))
    storage.put(key, [seal(header, [payload], None), payload])
    return key


def report(storage, window=2.0, objects=False):
    return inspect.build_report(storage, JobKeys(), window, objects)


def test_a_stalled_generation_names_its_straggler_and_an_aborted_one_the_signal(
        storage, clock):
    announce(storage, "a", 3, TOKEN_A)
    heartbeat(storage, GEN_A, 0, 10, 9)
    heartbeat(storage, GEN_A, 1, 10, 8)
    contribution(storage, GEN_A, 9, 0)
    # both beat (alive) and neither moves on: rank 0 waits in 9 for rank 1, stuck in 8
    clock.call_later(0.3, lambda: (heartbeat(storage, GEN_A, 0, 11, 9),
                                   heartbeat(storage, GEN_A, 1, 11, 8)))
    announce(storage, "b", 0, TOKEN_B)
    heartbeat(storage, GEN_B, 0, 5, 4, state="closed")
    record(storage, names.within(GEN_B, names.abort(1)),
           {"type": "SystemExit", "message": "143", "collective": 4})
    found = report(storage)
    live, done = found["generations"]
    assert (live["status"], live["stragglers"], live["job"]) == ("live", [1], "a")
    assert live["progress"] == {"from": 9, "to": 9, "seconds": live["progress"]["seconds"],
                                "stalled": True}
    assert done["status"] == "finished" and done["aborts"][0]["rank"] == 1
    text = inspect.render(found)
    assert f"generation 3  {GEN_A}  LIVE  job a  world 2  3 objects" in text
    assert "progress: collective 9 -> 9 in" in text and "(STALLED)" in text
    assert "stragglers (the others wait for them): ranks [1]" in text
    assert "  0     live       10 -> 11" in text
    assert "ABORT rank 1 at collective 4: terminated by SIGTERM" in text
    assert "job a (rdzv.a/): 1 announcement(s) (newest 3)" in text


def test_without_a_watch_nothing_is_judged_and_an_empty_place_says_so(storage, clock):
    text = inspect.render(report(storage, window=0))
    assert "heartbeats not watched (--watch 0): liveness not judged" in text
    assert "nothing here yet (no ferrosync job has used this location)" in text
    assert clock.slept == 0.0


def test_claims_objections_and_announcements_it_cannot_verify_are_reported(storage):
    secret = b"k" * 32
    ns = names.namespace("c")
    announce(storage, "c", 0, TOKEN_A, joins={"0": [0, "x"], "1": [2, "y"]})
    record(storage, names.within(ns, "join.r1.2"), {})
    record(storage, names.within(ns, "join.r1.3"), {})  # after the announcement took 2
    record(storage, names.within(ns, "end.r0.0"), {})
    record(storage, names.within(ns, "join.r0.0"), {})
    record(storage, names.within(ns, "dup.r1.3"), {"attempt": 2, "host": "node9", "pid": 7})
    # an announcement sealed with a key the operator does not hold
    record(storage, names.within(ns, names.announcement(1)), {"token": TOKEN_B}, secret)
    (job,) = report(storage, window=0)["jobs"]
    assert job["unconsumed_joins"] == {"1": 3} and job["open_claims"] == {"1": 3}
    # the unverified record still names a directory: it protects, and is reported
    assert job["announced_without_data"] == [0, 1] and job["untrusted_announcements"] == [1]
    assert job["objections"][0]["by_attempt"] == 2
    text = "\n".join(inspect._render_job(job))
    assert "ranks waiting for rank 0 to announce, or that gave up): ranks [1]" in text
    assert "OBJECTION rank 1 claim 3 by claim 2 (pid 7 on node9)" in text
    assert "announced generations with no data left (collected, or a world of one): 0-1" in text
    assert "announcements it cannot verify: generation(s) 1" in text


def test_object_headers_are_described_and_junk_ones_said_unreadable(storage):
    announce(storage, "a", 3, TOKEN_A)
    good = contribution(storage, GEN_A, 1, 0, count=1 << 16)
    junk = names.within(GEN_A, names.contribution(1, 1))
    storage.objects[junk] = b"\x01" * 300
    (gen,) = report(storage, window=0, objects=True)["generations"]
    listed = {o["key"]: o for o in gen["object_list"]}
    assert listed[good]["header"] == {
        "kind": KIND_NAMES[KIND_CONTRIB], "rank": 0, "world_size": 2, "collective": 1,
        "slice": 0, "nslices": 1,
        "count": 1 << 16, "weight": 2.0, "payload_bytes": 4 << 16, "authenticated": False,
        "size_matches": True}
    assert listed[junk]["header"].startswith("unreadable: ")
    text = "\n".join(inspect._render_generation(gen))
    assert "rank 0 collective 1 slice 0/1 count 65536 weight 2" in text
    assert f"{junk}  300 B  unreadable: " in text


@pytest.mark.parametrize("url, billed", [("memory://unit", False), ("s3://b/run", True)])
def test_each_ranks_requests_add_up_per_hour_from_its_own_clock(clock, url, billed):
    storage = MemoryStorage(url, clock=clock)
    announce(storage, "a", 3, TOKEN_A)
    for rank in (0, 1):
        heartbeat(storage, GEN_A, rank, 1, 2, state="closed", connected_at=1000.0,
                  wall_time=1000.0 + 1800, requests={"requests": 500, "puts": 200,
                                                     "gets": 300})
    contribution(storage, GEN_A, 2, 0)
    (gen,) = report(storage, window=0)["generations"]
    summary = gen["storage_requests"]
    assert (summary["requests_so_far"], summary["requests_per_hour"], summary["ranks"]) == (
        1000, 2000, 2)
    assert (summary["request_cost_per_hour"] is not None) == billed
    text = "\n".join(inspect._render_generation(gen))
    assert "storage requests: 1,000 so far" in text and "2,000/hour" in text
    assert ("at S3 list prices" in text) == billed


def test_a_directorys_requests_are_file_operations(clock):
    """On a directory nothing is billed: the rates are named for what they count."""
    storage = MemoryStorage("/mnt/nfs/run", clock=clock)  # the URL of a directory
    announce(storage, "a", 3, TOKEN_A)
    heartbeat(storage, GEN_A, 0, 1, 2, state="closed", connected_at=1000.0,
              wall_time=1000.0 + 3600, requests={"requests": 70, "puts": 30, "gets": 40})
    (gen,) = report(storage, window=0)["generations"]
    assert gen["storage_requests"]["requests_are"] == "file operations"
    assert gen["storage_requests"]["request_cost_per_hour"] is None
    text = "\n".join(inspect._render_generation(gen))
    assert "  file operations: 70 so far, 70/hour over 1 ranks" in text
    assert "storage requests" not in text


def test_the_headers_object_count_adds_up_to_the_generations_and_the_records(storage):
    """The header's total is broken down into what each generation's line counts, the
    rendezvous records and the rest: no two counts of "objects" that disagree."""
    announce(storage, "a", 3, TOKEN_A)
    heartbeat(storage, GEN_A, 0, 10, 9, state="closed")
    heartbeat(storage, GEN_A, 1, 10, 9, state="closed")
    contribution(storage, GEN_A, 9, 0)
    announce(storage, "b", 0, TOKEN_B)
    heartbeat(storage, GEN_B, 0, 5, 4, state="closed")
    storage.put("notes.txt", [b"a user's file"])  # foreign: counted as "other"
    found = report(storage, window=0)
    text = inspect.render(found)
    per_generation = [int(n) for n in re.findall(r"^generation .*  world \d+  (\d+) objects",
                                                 text, re.M)]
    header = text.splitlines()[1]
    m = re.match(r"storage: (\d+) objects, .* in all: (\d+) in (\d+) generation\(s\), "
                 r"(\d+) rendezvous records of 2 job\(s\) .*, (\d+) other ", header)
    assert m, header
    total, in_gens, gens, records, other = map(int, m.groups())
    assert (gens, in_gens) == (2, sum(per_generation)) and per_generation == [3, 1]
    assert (records, other) == (2, 1)
    assert total == in_gens + records + other == found["total_objects"]


def test_names_planted_in_storage_cannot_forge_a_line_of_the_report(storage):
    storage.objects["notes\nABORT rank 0: forged\u202e"] = b"x"
    text = inspect.render(report(storage, window=0))
    assert "notes\\nABORT rank 0: forged\\u202e" in text
    assert not any(line.startswith("ABORT") for line in text.splitlines())


@pytest.mark.parametrize("numbers, text", [([0, 1, 2, 5, 7, 8], "0-2, 5, 7-8"), ([4], "4"),
                                           ([], "")])
def test_ranges_are_written_compactly(numbers, text):
    assert inspect._ranges(numbers) == text
