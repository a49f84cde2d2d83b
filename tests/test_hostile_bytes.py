"""Hostile bytes at the names a running job reads: oversized, sparse, deeply nested.

Storage is untrusted input, and a size it reports is a claim: nothing is allocated or
read by it before it is checked against the largest legal object of that kind (a
control record's ``RECORD_LIMIT``, a contribution's size from the layout), and a JSON
record is parsed only depth-bounded, after its MAC where there is a secret. Whatever
is planted, ranks fail with a ferrosync error quickly and within a bounded address
space; a peer's relayed error is never empty.

End to end, real rank processes run under ``RLIMIT_AS`` = 4 GiB (a 2**40-byte sparse
file read into memory would fail with ``MemoryError``, a 1 GiB one would take seconds
and the memory).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time

import pytest
import torch

import ferrosync
from ferrosync.errors import FerrosyncError, PeerFailed, ShardCorrupt, relay_text, relayed
from ferrosync.storage.engines import RECORD_LIMIT, LocalStorage, open_storage
from ferrosync.storage.wire import (
    JSON_MAX_DEPTH,
    decode_record,
    encode_record,
    json_depth,
    loads_bounded,
    open_record,
)
from ranks import RankFailure, collect, start_ranks, wait_until

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 3.0}
NESTED = b"[" * 500_000  # under the 1 MiB record limit; json.loads would recurse
ADDRESS_SPACE = 4 << 30
BOUND_S = 20.0  # the bound for a refusal (it takes well under a second)


def plant(path: str, what: str) -> None:
    """Put ``what`` at ``path`` atomically (a temp name, then rename), as a writer
    with access to the directory could."""
    tmp = path + ".planting"
    with open(tmp, "wb") as f:
        if what == "sparse-1TiB":
            f.truncate(1 << 40)
        elif what == "sparse-1GiB":
            f.truncate(1 << 30)
        elif what == "nested":
            f.write(NESTED)
        elif what == "nested-record":  # a well-formed envelope around a nested body
            f.write(json.dumps({"v": 1, "body": "[" * 500_000}).encode())
        else:
            raise AssertionError(what)
    os.replace(tmp, path)


# -- the storage layer -------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["sparse-1TiB", "sparse-1GiB"])
@pytest.mark.unit
def test_a_local_read_checks_the_size_before_reading(tmp_path, what):
    storage = LocalStorage(str(tmp_path / "run"))
    storage.makedirs("g1")
    plant(os.path.join(storage.root, "g1", "abort.r1"), what)
    t0 = time.monotonic()
    with pytest.raises(ShardCorrupt, match="more than the 1048576 bytes") as info:
        storage.read("g1/abort.r1", rank=3)
    assert time.monotonic() - t0 < 1.0
    assert info.value.rank == 3 and info.value.path.endswith("g1/abort.r1")
    assert "remove it" in str(info.value)
    assert storage.counters.snapshot()["bytes_read"] == 0  # refused unread
    # a caller that expects more passes its own bound; open() without one streams
    with pytest.raises(ShardCorrupt):
        storage.open("g1/abort.r1", max_bytes=1 << 20)
    reader = storage.open("g1/abort.r1")
    with reader:
        assert reader.size == (1 << 40 if what == "sparse-1TiB" else 1 << 30)


@pytest.mark.unit
def test_an_object_store_read_asks_for_one_byte_more_than_the_bound():
    storage = open_storage("memory://hostile-bytes")
    big = b"x" * (RECORD_LIMIT + 4096)
    storage.put("rec", [big])
    before = storage.counters.snapshot()["bytes_read"]
    with pytest.raises(ShardCorrupt, match="larger than the 1048576 bytes"):
        storage.read("rec")
    assert storage.counters.snapshot()["bytes_read"] - before == RECORD_LIMIT + 1
    assert storage.read("rec", max_bytes=len(big)) == big
    assert storage.read("rec", max_bytes=None) == big
    storage.put("small", [b"abc"])
    assert storage.read("small") == b"abc"


def test_an_oversized_object_on_s3_costs_one_bounded_get(s3_transport):
    """The real driver against a real (moto) server: a ranged GET, O(bound) bytes."""
    storage = open_storage(s3_transport.url, s3_transport.options["storage_options"])
    big = os.urandom(3 * RECORD_LIMIT)
    storage.put("abort.r1", [big])
    before = storage.counters.snapshot()
    with pytest.raises(ShardCorrupt) as info:
        storage.read("abort.r1", rank=0)
    after = storage.counters.snapshot()
    assert after["bytes_read"] - before["bytes_read"] == RECORD_LIMIT + 1
    assert after["gets"] - before["gets"] == 1
    assert info.value.rank == 0 and info.value.path.endswith("abort.r1")
    assert storage.read("abort.r1", max_bytes=len(big)) == big


# -- records: MAC first, depth-bounded parse ------------------------------------------------

@pytest.mark.parametrize("key", [None, b"k"], ids=["no-secret", "secret"])
@pytest.mark.parametrize("raw", [
    NESTED,
    b'{"v": 1, "body": "x", "mac": ' + b"[" * 100_000 + b"}",
    json.dumps({"v": 1, "body": "[" * 500_000}).encode(),
    json.dumps({"v": 1, "body": "[" * 500_000, "mac": "0" * 64}).encode(),
    json.dumps({"v": 1, "body": '{"a":' * 100_000 + "1" + "}" * 100_000}).encode(),
], ids=["bare", "deep-envelope", "deep-body", "deep-body-mac", "deep-objects"])
@pytest.mark.unit
def test_deep_records_are_refused_without_recursion(raw, key):
    assert len(raw) <= RECORD_LIMIT
    opened = open_record(raw, key)
    assert opened.body is None and not opened.trusted
    with pytest.raises(ShardCorrupt, match="unreadable control record"):
        decode_record(raw, key, path="p", rank=1)


@pytest.mark.unit
def test_the_body_of_a_record_is_parsed_only_after_its_mac():
    record = {"beat": 3, "nested": [[[1]]]}
    signed = encode_record(record, b"k")
    assert open_record(signed, b"k").body == record
    forged = json.loads(signed)
    forged["body"] = '{"beat": 4}'
    opened = open_record(json.dumps(forged).encode(), b"k")
    assert (opened.auth, opened.body) == ("forged", None)
    # what ferrosync itself writes nests far below the bound
    assert json_depth(encode_record({"a": {"b": [1, {"c": 2}]}}, None)) == 1
    assert loads_bounded('{"s": "' + "[" * 100 + '"}')  # inside a string: no nesting
    with pytest.raises(ValueError, match="nested 65 levels"):
        loads_bounded("[" * (JSON_MAX_DEPTH + 1) + "]" * (JSON_MAX_DEPTH + 1))
    assert loads_bounded("[" * JSON_MAX_DEPTH + "]" * JSON_MAX_DEPTH)


@pytest.mark.unit
def test_a_relayed_error_is_never_empty():
    assert relay_text(MemoryError()) == "MemoryError (raised without a message)"
    assert relay_text(ValueError("bad")) == "bad"
    assert relayed("") == relayed(None) == "(no message given: see that rank's log)"


# -- a running job -----------------------------------------------------------------------------

def gen_dir(url: str) -> str:
    (gen,) = [n for n in os.listdir(url) if n.startswith("g") and "." in n]
    return os.path.join(url, gen)


def w_held(rank, world, url, secret, paused, go):
    """One average, then (rank 0 only, under a 4 GiB address space) wait for ``go`` and
    average again; rank 1 just waits for ``go`` (the test stops it meanwhile)."""
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, secret=secret,
                           **FAST) as sync:
        x = torch.full((64,), float(rank))
        sync.average_(x)
        open(f"{paused}.{rank}", "w").close()
        wait_until(lambda: os.path.exists(f"{go}.{rank}"), "go", timeout=60)
        if rank == 0:
            resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        t0 = time.monotonic()
        try:
            sync.average_(x)
        except FerrosyncError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - t0
        return "ok", "", time.monotonic() - t0


@pytest.mark.parametrize("name, what, secret", [
    ("abort.r1", "sparse-1TiB", None), ("abort.r1", "sparse-1TiB", "s3cret"),
    ("abort.r1", "sparse-1GiB", None), ("abort.r1", "nested", None),
    ("abort.r1", "nested-record", None), ("abort.r1", "nested-record", "s3cret"),
    ("hb.r1", "sparse-1TiB", "s3cret"), ("hb.r1", "nested-record", None),
])
def test_hostile_bytes_at_a_running_jobs_records(tmp_path, name, what, secret):
    """Rank 1 is stopped (SIGSTOP: its heartbeat cannot replace what is planted);
    rank 0 enters a collective, reads rank 1's records and must fail typed, fast."""
    url, paused, go = str(tmp_path / "run"), str(tmp_path / "paused"), str(tmp_path / "go")
    procs, results = start_ranks(w_held, 2, url, secret, paused, go)
    stopped = False
    try:
        wait_until(lambda: all(os.path.exists(f"{paused}.{r}") for r in (0, 1)), "pause")
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = True
        plant(os.path.join(gen_dir(url), name), what)
        open(f"{go}.0", "w").close()
        out0 = collect({0: procs[0]}, results, timeout=60)[0]
    finally:
        if stopped:
            os.kill(procs[1].pid, signal.SIGCONT)
        open(f"{go}.1", "w").close()
        collect({1: procs[1]}, results, timeout=60)
    assert not isinstance(out0, RankFailure), out0  # a ferrosync error, returned
    kind, message, seconds = out0
    assert seconds < BOUND_S, out0
    if what.startswith("sparse"):
        # refused by its size, naming the reading rank and the planted path
        assert kind == "ShardCorrupt" and f"at {os.path.join(gen_dir(url), name)}" in message
        assert message.startswith("rank 0") and "refused unread" in message, out0
    elif name == "abort.r1":
        assert kind == "PeerFailed" and "unreadable abort marker" in message, out0
    else:  # an unreadable heartbeat counts as none: the stopped rank looks dead
        assert kind == "PeerFailed" and "rank 1 looks dead" in message, out0


def w_raise_memory_error(rank, world, url):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
        x = torch.ones(8)
        sync.average_(x)
        if rank == 1:
            raise MemoryError()
        sync.average_(x)


def test_a_peer_failing_without_a_message_is_reported_with_its_type(tmp_path):
    procs, results = start_ranks(w_raise_memory_error, 2, str(tmp_path / "run"))
    out = collect(procs, results, timeout=60)
    assert isinstance(out[1], RankFailure) and isinstance(out[1].error, MemoryError)
    err = out[0].error
    assert isinstance(err, PeerFailed), out
    assert "MemoryError (raised without a message)" in str(err), str(err)


@pytest.mark.parametrize("what", ["sparse-1TiB", "nested"])
@pytest.mark.unit
def test_hostile_bytes_at_a_rendezvous_record(tmp_path, what):
    """An announcement planted before the job starts: rank 0 refuses it, typed and at
    once, naming itself and the path."""
    url = str(tmp_path / "run")
    namespace = os.path.join(url, f"rdzv.{os.environ['FERROSYNC_JOB']}")
    os.makedirs(namespace)
    plant(os.path.join(namespace, "gen.0"), what)
    with pytest.raises(FerrosyncError) as info:
        ferrosync.connect(url, rank=0, world_size=1, timeout=20)
    assert str(info.value).startswith("rank 0, at ") and "gen.0" in str(info.value)
    assert isinstance(info.value, ShardCorrupt if what.startswith("sparse") else
                      ferrosync.ConfigError), info.value
