"""``core/async_runner.py``: one thread runs submissions in order; handles carry values and
errors, cannot be cancelled, and time out on their own wait only."""

from __future__ import annotations

import threading

import pytest

from ferrosync.core.async_runner import AsyncRunner, SyncHandle


@pytest.fixture
def runner():
    r = AsyncRunner("test-async")
    yield r
    r.stop()
    r.join(5.0)


def test_submissions_run_in_order_on_the_runner_thread(runner):
    seen = []
    handles = [runner.submit(lambda i=i: seen.append((i, runner.is_worker())) or i)
               for i in range(20)]
    runner.drain()
    assert [h.result() for h in handles] == list(range(20))
    assert seen == [(i, True) for i in range(20)]
    assert not runner.is_worker()  # the caller's thread is not the runner's


def test_an_error_stays_with_its_handle_and_later_submissions_still_run(runner):
    def boom():
        raise KeyError("lost")

    failed, after = runner.submit(boom), runner.submit(lambda: "next")
    runner.drain()
    with pytest.raises(KeyError, match="lost"):
        failed.wait()
    assert after.wait() == "next"


def test_a_handle_cannot_be_cancelled_and_its_wait_times_out_alone(runner):
    release = threading.Event()
    handle = runner.submit(lambda: release.wait(5.0) and "done")
    assert handle.cancel() is False
    with pytest.raises(TimeoutError, match="did not finish within 0.01 s"):
        handle.wait(0.01)
    release.set()
    assert handle.wait(5.0) == "done"


def test_a_collective_that_raised_timeout_error_is_not_mistaken_for_the_wait(runner):
    def times_out():
        raise TimeoutError("the collective's own timeout")

    handle = runner.submit(times_out)
    runner.drain()
    with pytest.raises(TimeoutError, match="the collective's own timeout"):
        handle.wait(0.01)


def test_stop_ends_the_thread_after_what_is_queued():
    r = AsyncRunner("test-async-stop")
    last = r.submit(lambda: 42)
    r.stop()
    r.join(5.0)
    assert last.result(0) == 42
    assert not any(t.name == "test-async-stop" for t in threading.enumerate())


def test_a_sync_handle_is_a_future():
    import concurrent.futures

    handle = SyncHandle()
    assert isinstance(handle, concurrent.futures.Future)
    handle.set_result(7)
    assert handle.wait() == 7 and handle.done()
