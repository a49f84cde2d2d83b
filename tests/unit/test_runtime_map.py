"""``Runtime.map``: calls in order of their results, ``width`` of them in flight at
once on the runtime's threads, the first error raised once every call ended."""

from __future__ import annotations

import threading

import pytest

from ferrosync.core import runtime

pytestmark = pytest.mark.unit

WIDTH = 4


def test_results_come_in_the_order_of_the_items():
    assert runtime.Runtime().map(lambda x: x * x, range(10), WIDTH) == [x * x for x in range(10)]
    assert runtime.Runtime().map(str, [], WIDTH) == []
    assert runtime.Runtime().map(str, [7], WIDTH) == ["7"]


def test_width_calls_run_at_once_and_never_more():
    # the barrier only opens when WIDTH calls wait at it together (twice: 2 * WIDTH
    # items); a call beyond the width would be counted in flight
    barrier = threading.Barrier(WIDTH, timeout=30)
    lock = threading.Lock()
    flight = {"now": 0, "most": 0}

    def call(x):
        with lock:
            flight["now"] += 1
            flight["most"] = max(flight["most"], flight["now"])
        barrier.wait()
        with lock:
            flight["now"] -= 1
        return x

    assert runtime.Runtime().map(call, range(2 * WIDTH), WIDTH) == list(range(2 * WIDTH))
    assert flight["most"] == WIDTH


def test_the_first_error_is_raised_after_every_call_ended():
    ended = []
    started = threading.Barrier(3, timeout=30)  # all three calls are in flight

    def call(x):
        started.wait()
        if x == 2:
            raise ValueError("item 2")
        ended.append(x)
        return x

    with pytest.raises(ValueError, match="item 2"):
        runtime.Runtime().map(call, range(3), WIDTH)
    assert sorted(ended) == [0, 1]


def test_a_slow_call_holds_up_no_other_item():
    # item 0 waits until every other item is done: a thread free sooner takes the
    # next item, so the one other thread does all five (a fixed stripe per thread
    # would leave items 2 and 4 behind item 0 until its wait timed out)
    others = threading.Semaphore(0)
    waited = []

    def call(x):
        if x == 0:
            waited.append(all(others.acquire(timeout=10) for _ in range(5)))
        else:
            others.release()
        return x

    assert runtime.Runtime().map(call, range(6), 2) == list(range(6))
    assert waited == [True]
