"""Bad input and broken peers: every failure is a typed, actionable error on every rank.

Synchronisation between the test and the ranks uses files the test creates or
waits for (never sleeps): e.g. rank 0 waits for a "go" file that the test writes
only after it has damaged rank 1's published contribution.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ferrosync
from ferrosync.errors import (
    ConfigError,
    DuplicateRank,
    FerrosyncError,
    LayoutMismatch,
    PeerFailed,
    ShardCorrupt,
    SyncTimeout,
)
from ranks import RankFailure, collect, run_ranks, start_ranks

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}


def wait_for_path(pattern: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = glob.glob(pattern)
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"{pattern} did not appear within {timeout} s")


def wait_until_file(path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


# -- connect-time validation (no peers needed) -------------------------------------------

@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"rank": 2, "world_size": 2}, "rank must be in [0, 2)"),
        ({"rank": 0, "world_size": 0}, "world_size must be >= 1"),
        ({"rank": -1, "world_size": 2}, "rank must be in"),
        ({"rank": 0, "world_size": 1, "timeout": 0}, "timeout must be a positive"),
        ({"rank": 0, "world_size": 1, "reduce": "tree"}, "reduce must be one of"),
        ({"rank": 0, "world_size": 1, "wire_dtype": "int4"}, "wire_dtype must be one of"),
        ({"rank": 0, "world_size": 1, "heartbeat_timeout": -1}, "heartbeat_timeout"),
        ({"rank": 0, "world_size": 1, "no_such_option": 1}, "unknown option"),
    ],
)
def test_connect_rejects_bad_arguments_before_io(tmp_path, kwargs, needle):
    url = str(tmp_path / "never-created")
    with pytest.raises(ConfigError) as info:
        ferrosync.connect(url, **kwargs)
    assert needle in str(info.value)
    assert not os.path.exists(url)  # validated before any I/O


@pytest.mark.unit
def test_environment_rank_without_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        ferrosync.connect(str(tmp_path))


@pytest.mark.unit
def test_no_url(monkeypatch):
    monkeypatch.delenv("FERROSYNC_URL", raising=False)
    with pytest.raises(ConfigError, match="FERROSYNC_URL"):
        ferrosync.connect()


@pytest.mark.unit
def test_unknown_scheme():
    with pytest.raises(ConfigError, match="unknown URL scheme 'nosuch'"):
        ferrosync.connect("nosuch://x/y", rank=0, world_size=1)


def test_missing_driver_names_the_package():
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="pip install gcsfs"):
        ferrosync.connect("gs://bucket/run", rank=0, world_size=1)


def test_missing_s3fs_gives_install_hint(tmp_path):
    # a real interpreter in which s3fs cannot be imported
    code = textwrap.dedent("""
        import sys
        sys.modules["s3fs"] = None
        import ferrosync
        try:
            ferrosync.connect("s3://bucket/run", rank=0, world_size=1)
        except ferrosync.ConfigError as exc:
            print("ERR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "ERR" in out.stdout, out.stderr
    assert "pip install 'ferrosync[s3]'" in out.stdout


@pytest.mark.unit
def test_unusable_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot use this location") as info:
        ferrosync.connect(str(blocker / "run"), rank=0, world_size=1)
    assert str(blocker) in str(info.value)


def test_missing_bucket(s3_transport):
    url = "s3://no-such-bucket-ferrosync/run"
    with pytest.raises(ConfigError, match="does not exist"):
        ferrosync.connect(url, rank=0, world_size=1, **s3_transport.options)


# -- peers that never come -----------------------------------------------------------------

def w_connect_only(rank, world, url, options):
    with ferrosync.connect(url, rank=rank, world_size=world, **options):
        pass


def test_rendezvous_timeout_names_missing_ranks(dir_transport):
    results = run_ranks(w_connect_only, 3, dir_transport.url, {"timeout": 2.0},
                        ranks=[0, 1], expect_errors=True)
    assert isinstance(results[0], RankFailure)
    err0 = results[0].error
    assert isinstance(err0, SyncTimeout) and "[2]" in str(err0), err0
    assert dir_transport.url in str(err0)
    err1 = results[1].error
    assert isinstance(err1, SyncTimeout) and "rank 0" in str(err1)


def w_stall_one(rank, world, url, options, release):
    if rank != 0:
        # only rank 0's timeout may fire: the others must hear about it from rank 0,
        # so the test does not depend on which of two equal timers fires first
        options = {**options, "timeout": 60.0}
    with ferrosync.connect(url, rank=rank, world_size=world, **options) as sync:
        if rank == world - 1:
            wait_until_file(release, 60)  # alive (heartbeating) but not participating
            return "released"
        sync.average_(torch.ones(4))


def test_collective_timeout_names_missing_rank(dir_transport, tmp_path):
    release = str(tmp_path / "release")
    procs, q = start_ranks(w_stall_one, 3, dir_transport.url, {"timeout": 2.0, **FAST},
                           release)
    out = collect({r: procs[r] for r in (0, 1)}, q, timeout=60)
    open(release, "w").close()
    out.update(collect({2: procs[2]}, q, timeout=60))
    err0, err1 = out[0].error, out[1].error
    assert isinstance(err0, SyncTimeout), err0
    assert "[2]" in str(err0) and "collective 1" in str(err0)
    # rank 1 (timeout 60 s) hears it from rank 0 (error record or abort marker)
    assert isinstance(err1, SyncTimeout) and "rank 0 " in str(err1), err1
    assert "[2]" in str(err1)


# -- layouts that do not match --------------------------------------------------------------

def w_layout(rank, world, url, options, variant):
    tensors = [torch.ones(4, 5), torch.ones(3)]
    if rank == 1:
        if variant == "shape":
            tensors[1] = torch.ones(6)
        elif variant == "count":
            tensors.append(torch.ones(2))
        elif variant == "dtype":
            tensors[0] = tensors[0].double()
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **options) as sync:
        if variant == "order" and rank == 1:
            sync.barrier()
        else:
            sync.average_(tensors)


@pytest.mark.parametrize("reduce", ["root", "sharded"])
@pytest.mark.parametrize(
    "variant, needle",
    [
        ("shape", "first difference at tensor 1: rank 0 has float32[3], rank 1 has float32[6]"),
        ("count", "rank 0 passed 2 tensors, rank 1 passed 3"),
        ("dtype", "first difference at tensor 0: rank 0 has float32[4, 5], rank 1 has "
                  "float64[4, 5]"),
        ("order", "rank 0 called average, rank 1 called barrier"),
    ],
)
def test_layout_mismatch_is_reported_on_every_rank(tmp_path, variant, needle, reduce):
    opts = {**FAST, "reduce": reduce, "sharded_min_bytes": 1}
    results = run_ranks(w_layout, 2, str(tmp_path / "run"), opts, variant,
                        expect_errors=True)
    for rank, res in enumerate(results):
        assert isinstance(res, RankFailure), (rank, res)
        assert isinstance(res.error, LayoutMismatch), (rank, res.error)
    text = str(results[0].error)
    if variant == "order":
        # detected by whichever rank looked first: worded from either side
        assert needle in text or "rank 1 called barrier, rank 0 called average" in text, text
    else:
        assert needle in text


# -- damaged objects -------------------------------------------------------------------------

def w_corrupt_target(rank, world, url, options, go):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **options) as sync:
        x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        if rank == 0:
            wait_until_file(go)  # the test damages rank 1's object first
        sync.average_(x)
        return x


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "append",
                                    "garbage"])
def test_damaged_contribution_is_never_averaged(tmp_path, damage):
    url = str(tmp_path / "run")
    go = str(tmp_path / "go")
    procs, q = start_ranks(w_corrupt_target, 2, url, {**FAST, "reduce": "root"}, go)
    target = wait_for_path(os.path.join(url, "g0.*", "c1.r1"))
    with open(target, "r+b") as f:
        data = bytearray(f.read())
        if damage == "flip-payload":
            data[500] ^= 0x10
        elif damage == "flip-header":
            data[50] ^= 0x01
        elif damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "append":
            data += b"\0" * 16
        else:
            data = bytearray(b"\x80\x04\x95not-a-shard" * 10)  # pickle-looking bytes
        f.seek(0)
        f.truncate()
        f.write(data)
    open(go, "w").close()
    out = collect(procs, q, timeout=60)
    for rank in (0, 1):
        assert isinstance(out[rank], RankFailure), out[rank]
        assert isinstance(out[rank].error, ShardCorrupt), out[rank].error
    assert "c1.r1" in str(out[0].error)


# -- generations: restarts, stale files, duplicates -------------------------------------------

def w_identity(rank, world, url, options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **options) as sync:
        x = torch.full((10,), float(rank))
        sync.average_(x)
        return sync.generation, sync.generation_url, x


def test_restart_in_same_directory_gets_a_new_generation(dir_transport):
    first = run_ranks(w_identity, 2, dir_transport.url, FAST)
    second = run_ranks(w_identity, 2, dir_transport.url, FAST)
    assert [r[0] for r in first] == [0, 0]
    assert [r[0] for r in second] == [1, 1]
    assert first[0][1] != second[0][1]
    for res in first + second:
        assert torch.equal(res[2], torch.full((10,), 0.5))


def test_stale_files_are_ignored(dir_transport):
    # leftovers of an earlier attempt whose rendezvous records are gone: a data
    # directory for generation 0 full of plausible names, and a torn temp file
    stale = os.path.join(dir_transport.url, "g0.0000000000000000")
    os.makedirs(stale)
    for name in ("c1.r1", "c1.out", "c1.r1.s0", "hb.r1", "abort.r1"):
        with open(os.path.join(stale, name), "wb") as f:
            f.write(b"FSYN" + os.urandom(200))
    results = run_ranks(w_identity, 2, dir_transport.url, FAST)
    for res in results:
        assert res[0] == 0
        assert torch.equal(res[2], torch.full((10,), 0.5))


def w_loop_until(rank, world, url, options, stop, started):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options) as sync:
        open(f"{started}.{rank}", "w").close()
        steps = 0
        go_on = torch.ones(1)
        while go_on.item():
            # rank 0 alone looks at the stop file and tells the others, so every rank
            # leaves the loop after the same collective
            go_on.fill_(0.0 if rank == 0 and os.path.exists(stop) else 1.0)
            sync.broadcast_(go_on, src=0)
            steps += 1
        return steps


def test_second_live_process_for_a_rank_is_refused(dir_transport, tmp_path):
    stop, started = str(tmp_path / "stop"), str(tmp_path / "started")
    procs, q = start_ranks(w_loop_until, 2, dir_transport.url, FAST, stop, started)
    wait_until_file(f"{started}.0")
    wait_until_file(f"{started}.1")
    intruder = run_ranks(w_connect_only, 2, dir_transport.url, {**FAST, "timeout": 30},
                         ranks=[1], expect_errors=True)
    open(stop, "w").close()
    out = collect(procs, q, timeout=60)
    assert isinstance(intruder[0], RankFailure)
    assert isinstance(intruder[0].error, DuplicateRank), intruder[0].error
    assert "rank 1 is still running" in str(intruder[0].error)
    assert all(isinstance(v, int) for v in out.values()), out  # the job was not disturbed


def test_two_processes_claiming_one_rank_at_once(dir_transport):
    # processes 1 and 2 both claim rank 1 of a world of 2; rank 0 starts once both
    # have asked to join, so the collision is certain, not a race
    procs, q = start_ranks(w_dup_rank, 3, dir_transport.url, ranks=[1, 2])
    rdzv = os.path.join(dir_transport.url, "rdzv." + os.environ["FERROSYNC_JOB"])
    wait_for_path(os.path.join(rdzv, "join.r1.0"))
    second = os.path.join(rdzv, "join.r1.1")
    deadline = time.monotonic() + 30
    # either both joined (attempts 0 and 1), or they collided on attempt 0 and the
    # loser already failed
    while not os.path.exists(second) and all(p.exitcode is None for p in procs.values()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    procs0, q0 = start_ranks(w_dup_rank, 3, dir_transport.url, ranks=[0])
    out = collect(procs, q, timeout=60)
    out.update(collect(procs0, q0, timeout=60))
    # neither claimant can tell which of them belongs with rank 0: both are refused,
    # and rank 0 fails with a typed error instead of averaging with either
    for res in (out[1], out[2]):
        assert isinstance(res, RankFailure) and isinstance(res.error, DuplicateRank), out
        assert "rank 1" in str(res.error)
    assert isinstance(out[0], RankFailure), out[0]
    assert isinstance(out[0].error, FerrosyncError), out[0].error


def w_dup_rank(rank, world, url):
    with ferrosync.connect(url, rank=min(rank, 1), world_size=2, timeout=20, **FAST) as sync:
        x = torch.ones(3)
        sync.average_(x)
        return x


# -- peers that fail -----------------------------------------------------------------------

def w_raise_in_block(rank, world, url, options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options) as sync:
        if rank == 1:
            raise ValueError("boom in the training loop")
        sync.average_(torch.ones(3))


@pytest.mark.timing
def test_exception_in_with_block_aborts_peers_fast(dir_transport):
    start = time.monotonic()
    results = run_ranks(w_raise_in_block, 2, dir_transport.url, FAST, expect_errors=True)
    elapsed = time.monotonic() - start
    err = results[0].error
    assert isinstance(err, PeerFailed), err
    assert "rank 1 failed" in str(err) and "ValueError: boom in the training loop" in str(err)
    assert elapsed < 30  # well before the 60 s collective timeout


def test_uncaught_exception_ending_the_process_aborts_peers(dir_transport, tmp_path):
    script = tmp_path / "rank1.py"
    script.write_text(textwrap.dedent(f"""
        import ferrosync
        sync = ferrosync.connect({dir_transport.url!r}, rank=1, world_size=2, timeout=60,
                                 heartbeat_interval=0.2, heartbeat_timeout=2.0)
        raise RuntimeError("uncaught at top level")
    """))
    child = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    results = run_ranks(w_connect_then_average, 2, dir_transport.url, ranks=[0],
                        expect_errors=True)
    _, stderr = child.communicate(timeout=60)
    assert "uncaught at top level" in stderr
    err = results[0].error
    assert isinstance(err, PeerFailed) and "RuntimeError: uncaught at top level" in str(err), err


def w_connect_then_average(rank, world, url):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **FAST) as sync:
        sync.average_(torch.ones(3))


def w_killed(rank, world, url, options, ready):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options) as sync:
        sync.barrier()
        if rank == 1:
            open(ready, "w").close()
            wait_until_file(ready + ".never", 120)  # killed here
        start = time.monotonic()
        try:
            sync.average_(torch.ones(3))
        except PeerFailed as exc:
            return time.monotonic() - start, str(exc)


@pytest.mark.timing
def test_sigkilled_peer_is_detected_by_heartbeat(dir_transport, tmp_path):
    ready = str(tmp_path / "ready")
    procs, q = start_ranks(w_killed, 2, dir_transport.url, FAST, ready)
    wait_until_file(ready)
    os.kill(procs[1].pid, signal.SIGKILL)
    out = collect({0: procs[0]}, q, timeout=60)
    elapsed, message = out[0]
    assert "rank 1 looks dead" in message
    assert elapsed < FAST["heartbeat_timeout"] + 3  # far below the 60 s timeout
