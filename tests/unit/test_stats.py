"""``core/stats.py``: a public collective counts once (nested calls included), with the
counter deltas and phase times of that call alone."""

from __future__ import annotations

import pytest

from ferrosync.core.stats import STAT_KEYS, StatsBook, empty_stats
from ferrosync.storage.engines.base import Counters


def test_empty_stats_have_every_key_as_ints_and_floats():
    stats = empty_stats()
    assert tuple(stats) == STAT_KEYS
    assert isinstance(stats["requests"], int) and isinstance(stats["wait_s"], float)


def test_a_collective_records_its_deltas_and_times_into_last_and_total():
    counters = Counters()
    counters.add(puts=5, written=100)  # before: not this collective's
    book = StatsBook(counters)
    with book.collective():
        counters.add(puts=2, gets=1, written=64, read=32, objects=1)
        book.add_time("write_s", 0.25)
        book.add_time("wait_s", 0.5)
    assert book.last["collectives"] == 1 and book.last["requests"] == 3
    assert (book.last["bytes_written"], book.last["bytes_read"]) == (64, 32)
    assert book.last["objects_written"] == 1
    assert (book.last["write_s"], book.last["wait_s"]) == (0.25, 0.5)
    with book.collective():
        counters.add(gets=1, read=8)
    assert book.last["requests"] == 1 and book.last["write_s"] == 0.0
    assert book.total["collectives"] == 2 and book.total["requests"] == 4
    assert book.total["bytes_read"] == 40


def test_nested_public_calls_count_once():
    counters = Counters()
    book = StatsBook(counters)
    with book.collective():
        with book.collective():  # average_gradients -> average_
            counters.add(puts=1)
        counters.add(puts=1)
    assert book.total["collectives"] == 1 and book.total["requests"] == 2


def test_time_outside_a_collective_is_not_counted_and_errors_still_record():
    counters = Counters()
    book = StatsBook(counters)
    book.add_time("read_s", 9.0)
    with book.phase("reduce_s"):
        pass
    assert book.total == empty_stats()
    with pytest.raises(RuntimeError), book.collective():
        counters.add(puts=1)
        raise RuntimeError("a failed collective's requests were still made")
    assert book.total["requests"] == 1 and book.total["collectives"] == 1


def test_phase_times_with_the_clock():
    book = StatsBook(Counters())
    with book.collective(), book.phase("read_s"):
        pass
    assert 0.0 <= book.last["read_s"] < 1.0
    assert book.as_dict() == {"total": book.total, "last": book.last}
