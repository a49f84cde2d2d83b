"""Per-collective and running statistics (``GradSync.stats``).

``stats["total"]`` and ``stats["last"]`` each hold the keys in ``STAT_KEYS``:
how many collectives ran, the bytes and storage requests they cost (every request,
heartbeats included), the collective data objects written (contributions, results;
not control records), and where the time went (write, wait, reduce, read).
``last`` is the most recent public call (one ``average_`` with several buckets
counts once).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

STAT_KEYS = (
    "collectives",
    "bytes_written",
    "bytes_read",
    "requests",
    "objects_written",
    "write_s",
    "wait_s",
    "reduce_s",
    "read_s",
)
_COUNTER_KEYS = ("requests", "bytes_written", "bytes_read", "objects_written")
PHASES = ("write_s", "wait_s", "reduce_s", "read_s")


def empty_stats() -> dict:
    return {key: 0 if key in _COUNTER_KEYS or key == "collectives" else 0.0 for key in STAT_KEYS}


class StatsBook:
    """Accumulates phase times and counter deltas around each public collective.

    ``counters`` is anything with ``snapshot() -> dict`` of the counter keys (the
    storage's request counters, or the torch backend's own).
    """

    def __init__(self, counters) -> None:
        self._counters = counters
        self.total = empty_stats()
        self.last = empty_stats()
        self._current: dict | None = None
        self._depth = 0

    @contextmanager
    def collective(self):
        # nested public calls (average_gradients -> average_) count once
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        before = self._counters.snapshot()
        self._current = empty_stats()
        try:
            yield
        finally:
            self._depth -= 1
            after = self._counters.snapshot()
            record = self._current
            self._current = None
            record["collectives"] = 1
            for key in _COUNTER_KEYS:
                record[key] = after.get(key, 0) - before.get(key, 0)
            self.last = record
            for key in STAT_KEYS:
                self.total[key] += record[key]

    def add_time(self, phase: str, seconds: float) -> None:
        if self._current is not None:
            self._current[phase] += seconds

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(name, time.perf_counter() - start)

    def as_dict(self) -> dict:
        return {"total": dict(self.total), "last": dict(self.last)}
