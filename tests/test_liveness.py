"""Liveness: a pause of the whole job is not a death, a death is still one.

The monitor's logic is tested on a fake clock (deterministic: no timer races), the
behaviour end to end on real processes stopped with SIGSTOP and killed with SIGKILL.
The tests synchronise with the ranks through what the ranks publish (their
heartbeat records, files they create), never by sleeping; the one sleep is the
pause under test itself.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import ferrosync
from ferrosync.errors import PeerFailed, StorageError
from ferrosync.storage.engines import RECORD_LIMIT, Counters, oversized
from ferrosync.storage.liveness import (
    MIN_FREEZE_S,
    Heartbeat,
    PeerMonitor,
    ProcessClock,
    SilenceClocks,
    freeze_bound,
    heartbeat_key,
)
from ferrosync.storage.wire import encode_record
from ranks import collect, read_heartbeat, start_ranks, wait_until

PREFIX = "g0.test"


# -- the monitor on a fake clock ----------------------------------------------------------

class FakeStorage:
    """Just what Heartbeat and PeerMonitor use: put, read, path_of, counters."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.objects: dict[str, bytes] = {}
        self.fail_puts: Exception | None = None

    def put(self, key, parts, *, exclusive=False, reuse=None):
        if self.fail_puts is not None:
            raise self.fail_puts
        self.objects[key] = b"".join(bytes(p) for p in parts)

    def read(self, key, *, max_bytes=RECORD_LIMIT, rank=None):
        data = self.objects.get(key)
        if data is not None and max_bytes is not None and len(data) > max_bytes:
            raise oversized(self.path_of(key), len(data), max_bytes, rank)
        return data

    def path_of(self, key):
        return f"fake://{key}"


class FakeTime:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def setup(interval=0.5, timeout=3.0):
    now = FakeTime()
    clock = ProcessClock(now)
    storage = FakeStorage()
    monitor = PeerMonitor(storage, PREFIX, 0, interval, timeout, None, "fake://run",
                          clock=clock)
    return now, clock, storage, monitor


def peer_beats(storage, beat, rank=1):
    record = {"beat": beat, "state": "running", "rank": rank, "collective": 1,
              "op": "average"}
    storage.objects[heartbeat_key(PREFIX, rank)] = encode_record(record, None)


def run_for(now, clock, monitor, seconds, step=0.1):
    """This process runs (ticks) for ``seconds``, checking every ``step``."""
    end = now.t + seconds
    while now.t < end - 1e-9:
        now.t += step
        clock.tick()
        monitor.check([0, 1], 1, "average")


@pytest.mark.unit
def test_silent_peer_is_dead_after_timeout_while_this_process_runs():
    now, clock, storage, monitor = setup()
    peer_beats(storage, 7)
    monitor.check([0, 1], 1, "average")
    run_for(now, clock, monitor, 2.9)  # not yet
    with pytest.raises(PeerFailed, match="heartbeat stuck at 7") as info:
        run_for(now, clock, monitor, 0.3)
    assert info.value.rank == 0 and info.value.collective == 1
    assert "hb.r1" in info.value.path


@pytest.mark.unit
def test_beating_peer_is_never_blamed():
    now, clock, storage, monitor = setup()
    for beat in range(100):
        peer_beats(storage, beat)
        run_for(now, clock, monitor, 0.5)


@pytest.mark.unit
def test_a_timeout_that_came_while_a_look_read_the_others_is_still_due():
    """A look reads peers one after the other: a peer read just short of its timeout
    (b: 29.95 s of 30) is judged at the next look at once, not a look period later."""
    clocks = SilenceClocks(30.0, 10.0, clock=ProcessClock(time_fn=lambda: 0.0))
    clocks.observe("a", 1, 100.0)
    clocks.observe("b", 1, 100.3)
    # the look that begins at a's timeout: a is past it, b not yet when read
    assert clocks.silent("a", 1, 130.1)
    clocks.forget("a")  # judged gone
    assert not clocks.silent("b", 1, 130.25)
    # after the look (now 130.4): b's moment came during it, so it is due already
    assert clocks.next_change(130.1) == pytest.approx(130.3)
    # counted from the look's end it would be lost until the next period
    assert clocks.next_change(130.4) is None
    assert clocks.silent("b", 1, 130.45)


@pytest.mark.unit
def test_a_peer_is_fresh_for_an_interval_and_a_quarter_after_its_counter_moved():
    clocks = SilenceClocks(30.0, 10.0, clock=ProcessClock(time_fn=lambda: 0.0))
    clocks.observe("p", 1, 100.0)
    clocks.observe("p", 2, 105.0)  # seen moving: running now
    assert clocks.fresh("p") and clocks.beat_gap == 12.5
    clocks.observe("p", 2, 117.4)
    assert clocks.fresh("p")
    clocks.observe("p", 2, 117.6)  # a beat is late: stop relying on it
    assert not clocks.fresh("p") and not clocks.silent("p", 2, 117.7)
    assert clocks.next_change(105.0, fresh_of=["p"]) == pytest.approx(117.5)


@pytest.mark.unit
def test_freeze_of_this_process_is_not_the_peers_silence():
    now, clock, storage, monitor = setup()
    peer_beats(storage, 7)
    run_for(now, clock, monitor, 2.0)  # 2 s of silence seen while running
    now.t += 10.0  # SIGSTOP for 10 s: no thread of this process ticks
    # resumed, and the peer has not beaten yet (it was frozen too): no blame
    run_for(now, clock, monitor, 2.9)
    peer_beats(storage, 8)  # the peer's first beat after resuming
    run_for(now, clock, monitor, 2.9)
    # a peer that does not beat for a full timeout after our resumption is dead
    with pytest.raises(PeerFailed, match="heartbeat stuck at 8"):
        run_for(now, clock, monitor, 0.3)


@pytest.mark.unit
def test_freeze_seen_first_by_another_thread_still_counts():
    now, clock, storage, monitor = setup()
    peer_beats(storage, 7)
    run_for(now, clock, monitor, 1.0)
    now.t += 10.0
    clock.tick()  # the heartbeat thread runs first after SIGCONT
    now.t += 0.01
    monitor.check([0, 1], 1, "average")  # the waiting thread's first check: no blame


@pytest.mark.unit
def test_gap_shorter_than_the_freeze_bound_counts_as_silence():
    now, clock, storage, monitor = setup(interval=0.5, timeout=3.0)
    assert freeze_bound(0.5) == 0.75 and freeze_bound(0.01) == MIN_FREEZE_S
    peer_beats(storage, 7)
    run_for(now, clock, monitor, 2.5)
    now.t += 0.7  # scheduling hiccup, not a freeze
    with pytest.raises(PeerFailed):
        monitor.check([0, 1], 1, "average")


@pytest.mark.unit
def test_failing_own_heartbeat_is_reported_typed():
    now, clock, storage, monitor = setup(interval=0.5, timeout=3.0)
    hb = Heartbeat(storage, PREFIX, 0, 0.5, None, 0, clock=clock)
    peer_beats(storage, 1)
    hb._beat()
    assert hb.failure(now.t) is None
    storage.fail_puts = StorageError("No space left on device", path="fake://hb.r0")
    # registered as the monitor's own heartbeat (start() also spawns the thread; the
    # test drives the beats itself)
    from ferrosync.storage import liveness
    liveness._HEARTBEATS[(id(storage), PREFIX, 0)] = hb
    try:
        for beat in range(2, 9):
            now.t += 0.5
            hb._beat()
            peer_beats(storage, beat)
            monitor.check([0, 1], 1, "average")  # failing for <= 3 s: keep waiting
        now.t += 0.5
        hb._beat()
        with pytest.raises(StorageError) as info:
            monitor.check([0, 1], 1, "average")
        text = str(info.value)
        assert "heartbeat could not be written" in text and "No space left" in text
        assert "rank 0" in text and "collective 1" in text
        assert isinstance(info.value.__cause__, StorageError)
        # and a dead peer seen meanwhile says the storage may be the culprit
        storage.fail_puts = None
        hb._beat()
        storage.fail_puts = OSError(28, "No space left on device")
        hb._beat()
        with pytest.raises(PeerFailed, match="own heartbeat writes have been failing"):
            run_for(now, clock, monitor, 3.5)
    finally:
        liveness._HEARTBEATS.pop((id(storage), PREFIX, 0), None)


# -- real processes -------------------------------------------------------------------------

HB = {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0}
PAUSE_S = 6.0  # longer than heartbeat_timeout




def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read() or None
    except OSError:
        return None


def wait_in_collective(gen_dir: str, rank: int, beats: int = 3) -> None:
    """Until ``rank``'s heartbeat has said "in collective 1" for ``beats`` beats: by
    then it has polled (and checked its peers) for a few intervals."""
    first = wait_until(lambda: (r := read_heartbeat(gen_dir, rank)) and r.get("collective") == 1
                       and r, f"rank {rank} entering collective 1")["beat"]
    wait_until(lambda: (r := read_heartbeat(gen_dir, rank)) and r["beat"] >= first + beats,
               f"rank {rank} waiting in collective 1")


def wait_for_beats(gen_dir: str, rank: int, beats: int) -> None:
    """Until ``rank`` has beaten ``beats`` more times (it runs: its heartbeat thread
    beats every interval, its waiting thread checks its peers as often), or stopped
    beating because it failed."""
    beat = wait_until(lambda: read_heartbeat(gen_dir, rank), "a heartbeat")["beat"]
    wait_until(lambda: (r := read_heartbeat(gen_dir, rank)) and (
        r["beat"] >= beat + beats or r["state"] != "running"), f"{beats} beats of rank {rank}")


def w_slow_peer(rank, world, url, slow, files):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, reduce="root",
                           **HB) as sync:
        with open(f"{files}.gen{rank}", "w") as f:
            f.write(sync.generation_url)
        x = torch.full((1000,), float(rank + 1))
        if rank == slow:
            # blocked outside any collective while the other rank waits for it
            wait_until(lambda: os.path.exists(f"{files}.go"), "go")
        sync.average_(x)
        return x


@pytest.mark.parametrize("slow", [0, 1], ids=["waiter-is-rank1", "waiter-is-rank0"])
def test_pausing_every_rank_is_not_a_failure(tmp_path, slow):
    files = str(tmp_path / "f")
    procs, q = start_ranks(w_slow_peer, 2, str(tmp_path / "run"), slow, files)
    waiter = 1 - slow
    gen_dir = wait_until(lambda: read_text(f"{files}.gen{waiter}"), "connect")
    wait_in_collective(gen_dir, waiter)
    # the job is suspended rank by rank: the slow rank first, then, once the waiter
    # has looked at the slow rank's last beat, the waiter
    os.kill(procs[slow].pid, signal.SIGSTOP)
    wait_for_beats(gen_dir, waiter, 2)
    os.kill(procs[waiter].pid, signal.SIGSTOP)
    time.sleep(PAUSE_S)  # the pause under test, not a synchronisation
    # the waiter resumes first and looks at its peer while the peer is still stopped
    # (whose last beat is now PAUSE_S old on the waiter's clock)
    os.kill(procs[waiter].pid, signal.SIGCONT)
    wait_for_beats(gen_dir, waiter, 2)
    os.kill(procs[slow].pid, signal.SIGCONT)
    open(f"{files}.go", "w").close()
    out = collect(procs, q, timeout=60)
    for rank in (0, 1):
        assert isinstance(out[rank], torch.Tensor), (rank, out[rank])
        assert torch.equal(out[rank], torch.full((1000,), 1.5)), (rank, out[rank][:3])


def w_victim(rank, world, url, files):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, reduce="root",
                           **HB) as sync:
        with open(f"{files}.gen{rank}", "w") as f:
            f.write(sync.generation_url)
        if rank == 1:
            wait_until(lambda: os.path.exists(f"{files}.never"), "never", 120)  # killed
        try:
            sync.average_(torch.ones(10))
        except PeerFailed as exc:
            return time.time(), str(exc)
        return None


@pytest.mark.timing
def test_sigkilled_peer_is_detected_within_the_heartbeat_timeout(tmp_path):
    files = str(tmp_path / "f")
    procs, q = start_ranks(w_victim, 2, str(tmp_path / "run"), files)
    gen_dir = wait_until(lambda: read_text(f"{files}.gen0"), "connect")
    wait_in_collective(gen_dir, 0)
    killed_at = time.time()
    os.kill(procs[1].pid, signal.SIGKILL)
    out = collect({0: procs[0]}, q, timeout=60)
    procs[1].join(5)
    failed_at, message = out[0]
    latency = failed_at - killed_at
    print(f"kill detected after {latency:.2f} s (heartbeat_timeout "
          f"{HB['heartbeat_timeout']} s, interval {HB['heartbeat_interval']} s)")
    assert "rank 1 looks dead" in message
    # generous: timeout + one check interval + slack for a loaded machine
    assert latency < HB["heartbeat_timeout"] + HB["heartbeat_interval"] + 5.0


class FailingHeartbeatWrites:
    """The rank's storage, except that heartbeat writes fail as on a full disk."""

    def __init__(self, storage) -> None:
        self._storage = storage

    def put(self, key, parts, **kwargs):
        if "/hb.r" in key:
            raise StorageError("No space left on device (injected)", path=key)
        return self._storage.put(key, parts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._storage, name)


def w_heartbeat_fails(rank, world, url, files):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, reduce="root",
                           heartbeat_interval=0.2, heartbeat_timeout=2.0) as sync:
        if rank == 0:
            # blocked outside any collective (so it blames nobody) until rank 1 failed
            wait_until(lambda: os.path.exists(f"{files}.done"), "rank 1 failed")
        else:
            records = sync._heartbeat._records  # where the heartbeat writes
            records.storage = FailingHeartbeatWrites(records.storage)
        try:
            # rank 0 may complete this one (rank 1's contribution is valid), not the next
            sync.average_(torch.ones(4))
            sync.barrier()
            return "completed"
        except (StorageError, PeerFailed) as exc:
            return exc
        finally:
            if rank == 1:
                open(f"{files}.done", "w").close()


def test_unwritable_heartbeat_is_reported_by_its_own_rank(tmp_path):
    from ranks import run_ranks

    out = run_ranks(w_heartbeat_fails, 2, str(tmp_path / "run"), str(tmp_path / "f"))
    err1 = out[1]
    assert isinstance(err1, StorageError), err1
    assert "heartbeat could not be written" in str(err1) and "injected" in str(err1)
    assert "hb.r1" in err1.path
    err0 = out[0]  # rank 0 hears of it through rank 1's abort marker, typed
    assert isinstance(err0, StorageError) and "rank 1 failed" in str(err0), err0
