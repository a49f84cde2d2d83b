"""Elastic members on the storage transport's object layer, in one process.

Several members of one job run in threads of this process over a directory (each its
own ``ElasticSync``: the thread rule is per ``GradSync``), so a protocol case costs no
process start-up: faults injected with ``FERROSYNC_FAULTS``, ``stats``, a tree round
whose layouts differ, a member that never writes its slices, and reads of the
published state (all in the unit tier), and the first contact with an unreachable store.
Real processes: tests/test_elastic.py.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import ferrosync
from conftest import free_port
from ferrosync.errors import ConfigError, LayoutMismatch, ShardCorrupt, StorageError
from ferrosync.storage import names
from ferrosync.storage.engines import ENV_FAULTS
from ferrosync.testing.faults import _object_kind

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.5}
TIMEOUT = 30.0


def in_threads(url: str, count: int, body, *, job: str, **options) -> list:
    """Run ``body(index, sync)`` for ``count`` members of one job, each connecting in its
    own thread in index order (so the founding roster lists them so); returns each
    member's result or the exception it raised."""
    out: list = [None] * count
    joined = [threading.Event() for _ in range(count)]

    def member(index: int) -> None:
        try:
            if index:
                joined[index - 1].wait(TIMEOUT)
            entry = os.path.join(url, names.elastic_namespace(job), names.elastic_join(index))
            threading.Thread(target=_set_when, args=(entry, joined[index]), daemon=True).start()
            with ferrosync.connect(url, elastic=True, min_ranks=count, job=job,
                                   timeout=TIMEOUT, **FAST, **options) as sync:
                out[index] = body(index, sync)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[index] = exc
            joined[index].set()

    threads = [threading.Thread(target=member, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    return out


def _set_when(path: str, event: threading.Event) -> None:
    """Set ``event`` once ``path`` exists (a member's join entry: its place is taken)."""
    while not event.is_set() and not os.path.exists(path):
        event.wait(0.005)
    event.set()


# -- fault injection and counters ----------------------------------------------------------------

@pytest.mark.unit
def test_fault_injection_reaches_an_elastic_member_and_stats_count_its_objects(
        tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_FAULTS, json.dumps([{
        "rank": 0, "collective": 2, "object": "contrib", "phase": "write",
        "action": "raise", "errno": "ENOSPC"}]))
    with ferrosync.connect(str(tmp_path), elastic=True, job="faults", timeout=TIMEOUT,
                           **FAST) as sync:
        t = torch.ones(8)
        assert sync.average_([t]) == 1.0  # round 1
        last = sync.stats["last"]
        assert last["objects_written"] == 1 and last["requests"] > 0
        assert last["bytes_written"] > t.numel() * 4
        with pytest.raises(StorageError, match="No space left"):
            sync.average_([t])  # round 2: its contribution's write fails
    assert sync.stats["total"]["objects_written"] == 1


@pytest.mark.unit
@pytest.mark.parametrize("name, kind", [
    ("el.j/" + names.elastic_contribution(3, "0123456789abcdef"), ("contrib", 3)),
    ("el/" + names.elastic_piece(4, 0, 2, (1,)), ("contrib", 4)),
    ("el.j/" + names.elastic_piece(4, 1, 0, (1, 0)), ("result", 4)),
    ("el.j/" + names.elastic_result(5, (0, 1)), ("result", 5)),
    ("el.j/r5.m.0.1", (None, None)),  # a data object outside its shard: not ferrosync's
    ("el.j/r5.roster", (None, None)),
    ("el.j/join.3", (None, None)),
    ("el.j/state.5", (None, None)),
    ("g1.0123456789abcdef/c3.r1.s0", ("contrib", 3)),
    ("g1.0123456789abcdef/c3.out", ("result", 3)),
    ("g1.0123456789abcdef/hb.r1", (None, None)),
])
def test_faults_know_elastic_objects_by_their_names(name, kind):
    assert _object_kind(name) == kind


# -- tree rounds: what went wrong, and whose fault it is -----------------------------------

@pytest.mark.unit
def test_a_layout_mismatch_in_a_tree_round_names_the_first_difference_everywhere(tmp_path):
    ids = {}

    def body(index, sync):
        ids[index] = sync.member_id
        sync.average_([torch.ones(64)])  # every member alike: a tree round (5 members)
        sync.average_([torch.ones(64 if index != 3 else 65)])
        return "averaged"

    got = in_threads(str(tmp_path), 5, body, job="layouts")
    assert all(isinstance(g, LayoutMismatch) for g in got), got
    for index, error in enumerate(got):
        text = str(error)
        assert "first difference at tensor 0" in text, text
        assert "float32[65]" in text and "float32[64]" in text, text
        if index != 3:  # every other member names the odd one
            assert f"member {ids[3]}" in text, text


@pytest.mark.unit
def test_a_member_that_never_wrote_its_slices_is_named_as_the_one_at_fault(tmp_path):
    culprit = {}

    def body(index, sync):
        sync.average_([torch.ones(64)])
        if index == 2:
            culprit["id"] = sync.member_id
            write = sync._exchange.write

            def without_slices(name, *args, **kwargs):  # its marker, but no slice
                if names.parse_elastic(name).kind != "elastic_piece":
                    write(name, *args, **kwargs)

            sync._exchange.write = without_slices
        sync.average_([torch.ones(64)])
        return "averaged"

    got = in_threads(str(tmp_path), 5, body, job="slices")
    others = [g for i, g in enumerate(got) if i != 2]
    assert all(isinstance(g, ShardCorrupt) for g in others), got
    for error in others:
        assert f"member {culprit['id']}" in str(error), error
        assert "never wrote its slice" in str(error), error


# -- state --------------------------------------------------------------------------------------

@pytest.mark.unit
def test_a_damaged_state_is_refused_and_the_callers_tensors_are_untouched(tmp_path):
    with ferrosync.connect(str(tmp_path), elastic=True, job="state", timeout=TIMEOUT,
                           **FAST) as sync:
        sync.publish_state({"w": torch.arange(1000, dtype=torch.float32)}, {"step": 7})
        got = sync.read_state()
        assert got.meta == {"step": 7} and torch.equal(got.tensors["w"], torch.arange(1000.0))
        key = os.path.join(str(tmp_path), "el.state", names.elastic_state(sync.round, 0))
        with open(key, "r+b") as f:  # one payload byte flipped on storage
            f.seek(-10, os.SEEK_END)
            byte = f.read(1)
            f.seek(-10, os.SEEK_END)
            f.write(bytes([byte[0] ^ 1]))
        mine = torch.zeros(1000)
        with pytest.raises(ShardCorrupt, match="checksum mismatch"):
            sync.fetch_state([mine])
        assert not mine.any()  # nothing unverified reached the caller's tensors
        with pytest.raises(ShardCorrupt, match="checksum mismatch"):
            sync.read_state()


@pytest.mark.unit
def test_a_state_of_several_parts_reads_back_exactly(tmp_path):
    """A state larger than a part (an eighth of it, at least 1 MiB) is published in
    parts that cut across its tensors; both reads put every byte back in place."""
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(700_000, generator=g),
             "b": torch.arange(50_000, dtype=torch.int64),
             "c": torch.randn(3, 100_000, generator=g).to(torch.bfloat16),
             "empty": torch.empty(0)}
    with ferrosync.connect(str(tmp_path), elastic=True, job="parts", timeout=TIMEOUT,
                           **FAST) as sync:
        sync.publish_state(state)
        parts = [n for n in os.listdir(tmp_path / "el.parts") if n.startswith("state.")]
        assert len(parts) == 4, parts  # 3.8 MB in 1 MiB parts
        got = sync.read_state().tensors
        assert list(got) == list(state)
        assert all(torch.equal(got[k], state[k]) for k in state)
        mine = {k: torch.zeros_like(v) for k, v in state.items()}
        sync.fetch_state(mine)
        assert all(torch.equal(mine[k], state[k]) for k in state)


def test_an_unreachable_store_fails_within_the_connect_timeout():
    """The elastic member opens its store with connect's first-contact timeout, as
    StorageSync does (without it botocore's own defaults took 30 s here)."""
    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k", "secret": "s"}
    start = time.monotonic()
    with pytest.raises(ConfigError, match="cannot reach|no answer from"):
        ferrosync.connect("s3://bucket/closed", elastic=True, timeout=5,
                          storage_options=options)
    assert time.monotonic() - start < 20
