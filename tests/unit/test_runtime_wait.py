"""``core/runtime.py``'s one bounded wait (``wait``) and its deadline rule (``passed``),
on a fake clock: what it returns, when it gives up, how it sleeps."""

from __future__ import annotations

import pytest

from fakes import FakeClock
from ferrosync.core import runtime

pytestmark = pytest.mark.unit


@pytest.fixture
def rt():
    return FakeClock().runtime()


def _after(clock, n):
    """An attempt that finds "found" at its ``n``-th call, logging the clock at each."""
    calls = []

    def attempt():
        calls.append(clock.now)
        return "found" if len(calls) >= n else None
    return attempt, calls


def _late():
    raise TimeoutError("late")


def test_a_hit_at_the_first_attempt_never_sleeps(rt):
    attempt, calls = _after(rt.clock, 1)
    assert runtime.wait(attempt, deadline=rt.clock.now + 5, poll=(0.1, 1), runtime=rt) == "found"
    assert len(calls) == 1 and rt.clock.slept == 0


def test_a_deadline_has_passed_once_the_clock_reads_it(rt):
    now = rt.clock.now
    assert runtime.passed(now, rt) and runtime.passed(now - 1, rt)
    assert not runtime.passed(now + 1e-9, rt)
    # a zero timeout: one attempt, then the caller's error, no sleep
    attempt, calls = _after(rt.clock, 99)
    with pytest.raises(TimeoutError, match="late"):
        runtime.wait(attempt, deadline=now, poll=(0.1, 1), runtime=rt,
                     expired=_late)
    assert len(calls) == 1 and rt.clock.slept == 0


def test_past_the_deadline_the_wait_ends_with_what_expired_returns(rt):
    attempt, calls = _after(rt.clock, 99)
    start = rt.clock.now
    got = runtime.wait(attempt, deadline=start + 1.0, poll=(0.25, 0.25), runtime=rt,
                       expired=lambda: "gave up")
    assert got == "gave up"
    assert calls == [start, start + 0.25, start + 0.5, start + 0.75, start + 1.0]
    attempt, _ = _after(rt.clock, 99)
    assert runtime.wait(attempt, deadline=rt.clock.now, poll=(1, 1), runtime=rt) is None


def test_back_off_doubles_to_its_cap_and_never_sleeps_past_the_deadline_or_wake(rt):
    attempt, calls = _after(rt.clock, 6)
    start = rt.clock.now
    runtime.wait(attempt, deadline=start + 100, poll=(0.01, 0.04), runtime=rt)
    gaps = [round(b - a, 6) for a, b in zip(calls, calls[1:])]
    assert gaps == [0.01, 0.02, 0.04, 0.04, 0.04]
    attempt, calls = _after(rt.clock, 3)
    start = rt.clock.now
    runtime.wait(attempt, deadline=start + 100, poll=(1.0, 1.0), wake=start + 0.3,
                 runtime=rt)
    assert calls[1] == pytest.approx(start + 0.3)  # woke at ``wake``, not after 1 s
    attempt, calls = _after(rt.clock, 99)
    start = rt.clock.now
    runtime.wait(attempt, deadline=start + 0.5, poll=(2.0, 2.0), runtime=rt)
    assert calls == [start, start + 0.5]  # the one sleep ended at the deadline


def test_between_runs_after_each_miss_before_the_deadline_is_judged(rt):
    order = []
    start = rt.clock.now

    def attempt():
        order.append("attempt")

    def between():
        order.append("between")
        return "peer failed" if rt.clock.now >= start + 1.0 else None

    # the deadline passes at the same look in which ``between`` has its answer: it wins
    got = runtime.wait(attempt, deadline=start + 1.0, poll=(0.5, 0.5), between=between,
                       expired=lambda: "timed out", runtime=rt)
    assert got == "peer failed"
    assert order == ["attempt", "between"] * 3


def test_a_moving_deadline_is_read_at_each_look(rt):
    start = rt.clock.now
    deadline = [start + 0.2]

    def attempt():
        if rt.clock.now >= start + 0.2 and deadline[0] < start + 1:
            deadline[0] = start + 1.0  # pushed back once (a freeze ended)

    got = runtime.wait(attempt, deadline=lambda: deadline[0], poll=(0.1, 0.1),
                       expired=lambda: rt.clock.now, runtime=rt)
    assert got == pytest.approx(start + 1.0)


def test_without_poll_each_attempt_blocks_on_its_own(rt):
    attempt, calls = _after(rt.clock, 4)
    assert runtime.wait(attempt, deadline=runtime.FOREVER, poll=None, runtime=rt) == "found"
    assert len(calls) == 4 and rt.clock.slept == 0


def test_sleeping_wraps_every_sleep(rt):
    attempt, _ = _after(rt.clock, 3)
    entered = []

    class Phase:
        def __enter__(self):
            entered.append(rt.clock.now)

        def __exit__(self, *exc):
            return False

    runtime.wait(attempt, deadline=rt.clock.now + 9, poll=(0.1, 0.1), sleeping=Phase,
                 runtime=rt)
    assert len(entered) == 2


def test_the_default_runtime_is_read_at_each_call(monkeypatch):
    clock = FakeClock().install(monkeypatch)
    attempt, calls = _after(clock, 99)
    assert runtime.wait(attempt, deadline=clock.now + 30, poll=(1, 8)) is None
    assert clock.slept == pytest.approx(30)  # on the fake clock: no real sleep
