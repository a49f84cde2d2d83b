"""The simulator's scheduler (ferrosync/testing/sim/scheduler.py): simulated threads run
one at a time in (virtual time, sequence) order, and the trace digest covers every
note, however the notes are batched before hashing."""

from __future__ import annotations

import hashlib

import pytest

from ferrosync.testing.sim import scheduler
from ferrosync.testing.sim.scheduler import Process, Scheduler

pytestmark = pytest.mark.unit


def _run(threads: int = 4, steps: int = 5):
    """``threads`` simulated threads, each sleeping a different period ``steps`` times
    and noting each wake-up; (what ran when, the notes, the digest, the switches)."""
    sched = Scheduler()
    procs = [Process(sched, f"p{i}", i) for i in range(threads)]
    ran, notes = [], []

    def worker(i: int) -> None:
        for k in range(steps):
            procs[i].runtime.sleep(0.125 * (i + 1))
            ran.append((sched.now, i))
            assert sched.current.name == f"p{i}/w"  # the baton is this thread's
            fields = ("tick", i, k)
            notes.append(repr((round(sched.now, 9), *fields)).encode())
            sched.note(*fields)

    for i in range(threads):
        sched.spawn(procs[i], f"p{i}/w", lambda i=i: worker(i))
    sched.run(sched.now + 3600.0)
    assert not sched.failures
    return ran, notes, sched.digest, sched.switches


def test_threads_run_one_at_a_time_in_virtual_time_order():
    ran, notes, _, switches = _run()
    assert len(ran) == 4 * 5
    times = [t for t, _ in ran]
    assert times == sorted(times)
    for i in range(4):  # each thread woke at each multiple of its period, none lost
        assert [t for t, j in ran if j == i] == [1000.0 + 0.125 * (i + 1) * k
                                                 for k in range(1, 6)]
    # at equal times, the wake-up scheduled first runs first: at 1000.25, thread 1
    # (asleep since 1000.0) before thread 0 (since 1000.125)
    assert ran[1:3] == [(1000.25, 1), (1000.25, 0)]
    assert ran[-1][0] == pytest.approx(1000.0 + 0.125 * 4 * 5)  # 4th thread's 5 sleeps
    assert switches >= len(ran)


def test_the_digest_is_every_note_in_order_whatever_the_batch(monkeypatch):
    _, notes, digest, _ = _run()
    assert digest == hashlib.blake2b(b"".join(notes), digest_size=16).hexdigest()
    monkeypatch.setattr(scheduler, "NOTE_BATCH", 3)  # batches end inside the run
    assert _run()[2] == digest
    monkeypatch.setattr(scheduler, "NOTE_BATCH", 1)
    assert _run()[2] == digest
    assert _run(steps=4)[2] != digest  # a different run, a different digest


def test_a_run_can_be_resumed_for_more_virtual_time():
    """``run(until)`` twice: the baton comes back to the driver between the runs."""
    sched = Scheduler()
    proc = Process(sched, "p", 0)
    seen = []

    def worker() -> None:
        for _ in range(4):
            proc.runtime.sleep(1.0)
            seen.append(sched.now)

    sched.spawn(proc, "w", worker)
    sched.run(1002.5)
    assert seen == [1001.0, 1002.0]
    sched.run(1010.0)
    assert seen == [1001.0, 1002.0, 1003.0, 1004.0]
