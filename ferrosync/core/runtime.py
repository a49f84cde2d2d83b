"""The one place the elastic layer takes time, waits and threads from.

A ``Runtime`` is one process's clocks, ``sleep``, back-off, events, locks, background
threads and liveness state; ``REAL`` is the process's own, ``DEFAULT`` what a layer
uses when none is passed. The elastic simulator gives each simulated member its own
(docs/elastic.md#simulation); a real run is unchanged.
"""

from __future__ import annotations

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
        """``storage.Backoff`` sleeping on this runtime."""
        from ferrosync.storage.engines.base import Backoff
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

    def token_hex(self, nbytes: int) -> str:
        """A random id (a member's): the simulator's comes from its seed."""
        return secrets.token_hex(nbytes)


REAL = Runtime()
#: the runtime of a layer built without one (``elastic``, ``liveness.Heartbeat``,
#: ``storage.objects.Objects``); tests that drive a fake clock replace it
DEFAULT = REAL


def default() -> Runtime:
    """``DEFAULT`` as it is now (read late, so a test's replacement takes effect)."""
    return DEFAULT
