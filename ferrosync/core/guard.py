"""The ownership guard: which process and which thread may run a ``GradSync``'s collective.

The one home of the thread rule and the fork rule (docs/design.md#threads,
docs/design.md#forked-children) and of failing a ``GradSync``, which holds an
``OwnershipGuard`` and runs every collective through its ``run``: the first failure is
kept, the peers are told through the ``publish_abort`` callback, and every later call
raises ``SyncClosed``. The host provides ``Guarded`` (``rank``, ``url``, ``close()``).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from ferrosync.errors import ConfigError, FerrosyncError, SyncClosed

__all__ = ["Guarded", "OwnershipGuard", "fail_open_syncs"]

_log = logging.getLogger(__name__)


class Guarded(Protocol):
    """What the guard needs of the object it guards (a ``GradSync``): who it is, for
    errors (read at each use: an elastic member's rank changes), and ``close``, which
    the exit hook calls."""

    rank: int
    url: str

    def close(self) -> None: ...


class OwnershipGuard:
    """One process and, at any moment, one thread inside a collective of ``host``.

    ``publish_abort(exc)`` tells the peers that ``host`` failed (best effort; an error
    it raises is logged, never raised over the failure it reports).
    """

    def __init__(self, host: Guarded, publish_abort: Callable[[BaseException], None]) -> None:
        self._host = host
        self._publish_abort = publish_abort
        self._closed = False
        self._failure: BaseException | None = None
        # the process that connected: a forked child inherits this object, not the right
        # to use it (see the module docstring)
        self._pid = os.getpid()
        # held by a running collective so that close() from another thread waits for it;
        # never contended between collectives, which _enter keeps from overlapping
        self._lock = threading.RLock()
        # protects _owner/_depth/_failure transitions; held for a few instructions only,
        # never across I/O, so a thread checking for overlap never blocks
        self._guard = threading.Lock()
        self._owner: threading.Thread | None = None  # the thread inside a collective
        self._owner_op: str | None = None
        self._depth = 0  # nested calls by the owner (average_gradients -> average_)
        self._overlap: ConfigError | None = None  # the overlap that failed this GradSync
        _LIVE.add(self)

    @property
    def failure(self) -> BaseException | None:
        """The first failure (``fail``), or None."""
        return self._failure

    @property
    def closed(self) -> bool:
        return self._closed

    # -- running one collective ------------------------------------------------------------
    def run(self, op: str, body):
        """Run ``body`` as the host's next collective, on the calling thread.

        Refuses a forked child and a second thread (see the module docstring) before
        any I/O; fails the host (abort marker for the peers) if ``body`` raises. The
        caller has let earlier async submissions finish (call order is the contract).
        """
        self.check_process(op)
        self._enter(op)
        try:
            with self._lock:
                self.check_usable()
                try:
                    value = body()
                except BaseException as exc:
                    if self._failure is not None and not isinstance(exc, FerrosyncError):
                        # another thread failed this GradSync meanwhile and this is
                        # the fallout (state torn down under us): say so, typed
                        raise self._failed_meanwhile(op) from exc
                    self.fail(exc)
                    raise
                if self._failure is not None:
                    # failed by another thread while body ran: the ranks may have
                    # paired this call with another thread's, so the value is suspect
                    raise self._failed_meanwhile(op)
                return value
        finally:
            self._leave()

    def _enter(self, op: str) -> None:
        """Make the calling thread the one inside a collective, or fail: a second thread
        must not wait for its turn, because its turn would differ between ranks."""
        me = threading.current_thread()
        with self._guard:
            owner = self._owner
            if owner is None or owner is me:
                if owner is None:
                    self._owner, self._owner_op = me, op
                self._depth += 1
                return
            inside = self._owner_op
        error = ConfigError(
            f"thread {me.name!r} called {op} while thread {owner.name!r} is inside {inside} "
            "on the same GradSync; collectives from two threads must not overlap (each "
            "rank would order them its own way and average one thread's tensors with "
            "another's)",
            rank=self._host.rank, path=self._host.url,
            hint="call the collectives from one thread, or let a call return (join the "
            "thread, handle.wait()) before the next starts; this GradSync is now failed: "
            "close it and connect again (all ranks)",
        )
        with self._guard:
            if self._overlap is None:
                self._overlap = error
        self.fail(error)
        raise error

    def _leave(self) -> None:
        with self._guard:
            self._depth -= 1
            if self._depth == 0:
                self._owner = self._owner_op = None

    # -- checks ------------------------------------------------------------------------------
    def check_process(self, op: str) -> None:
        """Raise ``ConfigError`` in a forked child (``op`` names the refused call)."""
        if os.getpid() != self._pid:
            raise ConfigError(
                f"this GradSync belongs to pid {self._pid}; this is pid {os.getpid()}, a "
                f"forked child, which cannot run {op} on it (its storage handles, threads "
                "and collective sequence are the parent's)",
                rank=self._host.rank, path=self._host.url,
                hint="connect again in the child (ferrosync.connect(...) with the child's "
                "own rank and URL), or fork before connecting",
            )

    def check_usable(self) -> None:
        """Raise unless a collective may start now: this process's, open, not failed."""
        self.check_process("a collective")
        host = self._host
        if self._closed:
            raise SyncClosed("this GradSync is closed", rank=host.rank, path=host.url,
                             hint="connect again to start a new generation")
        if self._failure is not None:
            raise SyncClosed(
                f"an earlier collective failed ({type(self._failure).__name__}: "
                f"{self._failure})", rank=host.rank, path=host.url,
                hint="close this GradSync and connect again (all ranks)",
            )

    def raise_if_failed(self, op: str) -> None:
        """For a backend about to publish inside collective ``op``: raise if this
        GradSync was failed meanwhile (by another thread's overlapping call, an exit
        hook), so that nothing more is published that peers could pair with the wrong
        call."""
        if self._failure is not None:
            raise self._failed_meanwhile(op)

    def _failed_meanwhile(self, op: str) -> FerrosyncError:
        failure, host = self._failure, self._host
        if failure is self._overlap and isinstance(failure, ConfigError):
            return ConfigError(
                f"{op} on thread {threading.current_thread().name!r} ran while another "
                f"thread called a collective on the same GradSync ({failure.what}); its "
                "result is discarded (the tensors hold undefined values)",
                rank=host.rank, path=host.url, hint=failure.hint,
            )
        return SyncClosed(
            f"this GradSync was failed from another thread while {op} ran "
            f"({type(failure).__name__}: {failure}); its result is discarded (the tensors "
            "hold undefined values)",
            rank=host.rank, path=host.url,
            hint="close this GradSync and connect again (all ranks)",
        )

    # -- failing and closing -------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Record the first failure and tell the peers (abort marker); later calls and
        calls in a forked child do nothing (the child must not speak for the parent)."""
        if os.getpid() != self._pid:
            return
        with self._guard:
            if self._failure is not None:
                return
            self._failure = exc
        try:
            self._publish_abort(exc)
        except Exception:  # noqa: BLE001 - never mask the original error with this one
            _log.warning("rank %d: could not tell the peers this rank failed",
                         self._host.rank, exc_info=True)

    def fail_unless_ended(self, exc: BaseException) -> None:
        """``fail(exc)`` unless already failed or closed: for an error (or Ctrl-C) that
        ends the process or the ``with`` block while this GradSync is still open."""
        if self._failure is None and not self._closed:
            self.fail(exc)

    def close(self, shutdown: Callable[[BaseException | None], None]) -> None:
        """Mark closed (once, after a collective another thread runs), forget the host
        for the exit hooks and run ``shutdown(first failure or None)``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _LIVE.discard(self)
            shutdown(self._failure)

    def abandon(self) -> None:
        """Mark closed without a shutdown: for a backend whose ``__init__`` failed after
        it made the guard (it released what it had opened itself)."""
        self._closed = True
        _LIVE.discard(self)

    def close_forked_copy(self) -> bool:
        """In a forked child: mark this copy closed, touching nothing of the parent's
        (handles, threads, objects), and return True; in the owner, return False."""
        if os.getpid() == self._pid:
            return False
        self.abandon()
        return True


# -- aborting on process exit ----------------------------------------------------------------
#
# An uncaught exception that ends the process must leave an abort marker, or the
# peers would wait out their whole timeout. sys.excepthook runs before atexit, so
# it records the failure; atexit then closes whatever is still open.

_LIVE: weakref.WeakSet[OwnershipGuard] = weakref.WeakSet()
_previous_excepthook = sys.excepthook


def fail_open_syncs(exc: BaseException) -> None:
    """Fail every open GradSync of this process with ``exc``: each publishes its abort
    marker, so its peers raise ``PeerFailed`` now instead of waiting out a timeout.

    For code that ends the process on an exception it handles itself (the launcher's
    script runner prints a one-line error and exits 1): an uncaught exception does
    this through ``sys.excepthook``. A forked child's copies are the parent's and are
    left alone.
    """
    pid = os.getpid()
    for guard in list(_LIVE):
        if guard._pid == pid:
            guard.fail_unless_ended(exc)


def _excepthook(exc_type, exc, tb):
    fail_open_syncs(exc)
    _previous_excepthook(exc_type, exc, tb)


def _close_all() -> None:
    pid = os.getpid()
    for guard in list(_LIVE):
        if guard._pid != pid:
            continue  # a forked child exiting must not publish "closed" for the parent
        try:
            guard._host.close()
        except Exception:  # noqa: BLE001 - at exit: one sync must not stop the others
            _log.warning("could not close %r at exit", guard._host, exc_info=True)


sys.excepthook = _excepthook
atexit.register(_close_all)
