"""Where the elastic layer takes time and threads from; the package's one bounded ``wait``.

A ``Runtime`` is one process's clocks, ``sleep``, back-off, events, locks, background
threads and liveness state; ``REAL`` is the process's own, ``DEFAULT`` what a layer
uses when none is passed. The elastic simulator gives each simulated member its own
(docs/elastic.md#simulation); a real run is unchanged.
"""

from __future__ import annotations

import math
import secrets
import threading
import time


class Runtime:
    """The real process: ``time``, ``threading`` and the process-wide liveness clock."""

    #: this process's ``liveness.ProcessClock``; None: ``liveness.PROCESS_CLOCK``
    process_clock = None

    def __init__(self) -> None:
        #: member ids judged gone, by job namespace (``elastic.membership.HeartbeatWatch``)
        self.gone: dict[str, set[str]] = {}

    monotonic = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)
    time = staticmethod(time.time)  # last: the class body's ``time`` is this from here

    def Backoff(self, initial: float, cap: float):  # noqa: N802 - builds a Backoff
        """A ``Backoff`` sleeping on this runtime."""
        return Backoff(initial, cap, clock=self)

    def event(self) -> threading.Event:
        return threading.Event()

    def lock(self) -> threading.Lock:
        """A lock that may be held across a storage request (a wait point)."""
        return threading.Lock()

    def start_thread(self, target, name: str) -> threading.Thread:
        """Start ``target`` on a daemon thread; the handle has ``join(timeout)``."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def current_thread(self):
        return threading.current_thread()

    def map(self, fn, items, width: int) -> list:
        """``[fn(x) for x in items]`` with up to ``width`` calls in flight, on this
        runtime's threads (the simulator's run deterministically), the caller's among
        them; the first error of a call is raised once every call ended. Each call
        must bound itself (a storage request does): the joins below wait on them."""
        items = list(items)
        width = max(1, min(width, len(items)))
        results: list = [None] * len(items)
        errors: list[BaseException] = []
        # each thread takes the next item when it is free: with a fixed stripe per
        # thread, the map lasted as long as the slowest stripe's sum (a stripe that
        # drew a tail latency ran on alone: 1.6 s, not 0.9, for 1,000 GETs 64 wide
        # on the simulated S3)
        cursor, taking = iter(range(len(items))), threading.Lock()  # held for a next()

        def stripe() -> None:
            while not errors:
                with taking:
                    i = next(cursor, None)
                if i is None:
                    return
                try:
                    results[i] = fn(items[i])
                # broad on purpose: re-raised on the caller's thread below
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return

        threads = [self.start_thread(stripe, "ferrosync-map") for _ in range(1, width)]
        stripe()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results

    def token_hex(self, nbytes: int) -> str:
        """A random id (a member's): the simulator's comes from its seed."""
        return secrets.token_hex(nbytes)


class Backoff:
    """Sleep schedule for polling one exact name: doubling from ``initial`` to ``cap``.

    Starting well under a millisecond keeps small collectives fast on local disks;
    the cap bounds the request rate on billed object stores.
    """

    __slots__ = ("_delay", "_cap", "_clock")

    def __init__(self, initial: float, cap: float, *, clock=None) -> None:
        """``clock``: what has ``monotonic`` and ``sleep`` (a ``Runtime``; default the
        ``time`` module)."""
        self._delay = initial
        self._cap = cap
        self._clock = clock or time

    def sleep(self, deadline: float) -> None:
        remaining = deadline - self._clock.monotonic()
        self._clock.sleep(max(0.0, min(self._delay, remaining)))
        self._delay = min(self._delay * 2, self._cap)


REAL = Runtime()
#: the runtime of a layer built without one (``elastic``, ``liveness.Heartbeat``,
#: ``storage.objects.Objects``); tests that drive a fake clock replace it
DEFAULT = REAL


def default() -> Runtime:
    """``DEFAULT`` as it is now (read late, so a test's replacement takes effect)."""
    return DEFAULT


def passed(deadline: float, runtime: Runtime | None = None) -> bool:
    """The one rule for a deadline (``runtime.monotonic`` seconds): it has passed once
    the clock reads it or later (``>=``), so a zero timeout fails at the first look."""
    return (runtime or DEFAULT).monotonic() >= deadline


def wait(attempt, *, deadline, poll: tuple[float, float] | None, expired=None,
         between=None, wake: float | None = None, sleeping=None,
         runtime: Runtime | None = None):
    """The package's one bounded wait: ``attempt()`` until it returns something other
    than None, which is returned.

    After each miss ``between()`` runs, if given (it may raise, or return a value that
    ends the wait), then ``deadline`` is judged by ``passed`` (a number, ``math.inf``
    for none, or a function for a deadline that moves): past it the wait ends with
    ``expired()``, which raises the caller's error or returns the caller's result
    (None without ``expired``). Otherwise it sleeps by ``poll`` = (first sleep, cap),
    doubling (``Backoff``), never past the deadline nor ``wake``; ``poll`` None: no
    sleep (each attempt blocks on its own, bounded by the deadline). ``sleeping()``,
    if given, is a context around each sleep (a stats phase). Time and sleeps come
    from ``runtime`` (default ``DEFAULT``, read now: a test's fake clock applies).
    """
    clock = runtime or DEFAULT
    backoff = None
    while True:
        found = attempt()
        if found is not None:
            return found
        if between is not None:
            found = between()
            if found is not None:
                return found
        end = deadline() if callable(deadline) else deadline
        if passed(end, clock):
            return None if expired is None else expired()
        if poll is None:
            continue
        if backoff is None:
            backoff = clock.Backoff(*poll)
        until = end if wake is None else min(end, wake)
        if sleeping is None:
            backoff.sleep(until)
        else:
            with sleeping():
                backoff.sleep(until)


#: a wait without a deadline of its own (a launcher waiting on its children)
FOREVER = math.inf
