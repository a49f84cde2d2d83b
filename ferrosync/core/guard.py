"""The ownership guard: which process and which thread may run a ``GradSync``'s collective.

The one home of the thread rule and the fork rule (docs/design.md#threads,
docs/design.md#forked-children) and of failing a ``GradSync``: the first failure is
kept, the peers are told through ``_publish_abort``, and every later call raises
``SyncClosed``. The host class provides ``rank``, ``url``, ``_publish_abort(exc)``
(best effort, never raises) and ``close()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref

from ferrosync.core.async_runner import AsyncRunner
from ferrosync.errors import ConfigError, FerrosyncError, SyncClosed

__all__ = ["OwnershipGuard", "fail_open_syncs"]

_log = logging.getLogger(__name__)


class OwnershipGuard:
    """Mixin: one process and, at any moment, one thread inside a collective."""

    rank: int
    url: str

    def _init_guard(self) -> None:
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
        self._runner: AsyncRunner | None = None  # started by the first async submission
        _LIVE.add(self)

    # -- running one collective ------------------------------------------------------------
    def _collective(self, op: str, body):
        """Run ``body`` as this GradSync's next collective, on the calling thread.

        Refuses a forked child and a second thread (see the module docstring) before
        any I/O; waits for earlier async submissions when called from another thread;
        fails the GradSync (abort marker for the peers) if ``body`` raises.
        """
        self._check_process(op)
        if self._runner is not None and not self._runner.is_worker():
            self._runner.drain()  # earlier async collectives first: call order is the contract
        self._enter(op)
        try:
            with self._lock:
                self._check_usable()
                try:
                    value = body()
                except BaseException as exc:
                    if self._failure is not None and not isinstance(exc, FerrosyncError):
                        # another thread failed this GradSync meanwhile and this is
                        # the fallout (state torn down under us): say so, typed
                        raise self._failed_meanwhile(op) from exc
                    self._fail(exc)
                    raise
                if self._failure is not None:
                    # failed by another thread while body ran: the ranks may have
                    # paired this call with another thread's, so the value is suspect
                    raise self._failed_meanwhile(op)
                return value
        finally:
            self._leave()

    def _async_runner(self) -> AsyncRunner:
        """This GradSync's async thread, started on first use."""
        if self._runner is None:
            self._runner = AsyncRunner(f"ferrosync-async-r{self.rank}")
        return self._runner

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
            rank=self.rank, path=self.url,
            hint="call the collectives from one thread, or let a call return (join the "
            "thread, handle.wait()) before the next starts; this GradSync is now failed: "
            "close it and connect again (all ranks)",
        )
        with self._guard:
            if self._overlap is None:
                self._overlap = error
        self._fail(error)
        raise error

    def _leave(self) -> None:
        with self._guard:
            self._depth -= 1
            if self._depth == 0:
                self._owner = self._owner_op = None

    # -- checks ------------------------------------------------------------------------------
    def _check_process(self, op: str) -> None:
        if os.getpid() != self._pid:
            raise ConfigError(
                f"this GradSync belongs to pid {self._pid}; this is pid {os.getpid()}, a "
                f"forked child, which cannot run {op} on it (its storage handles, threads "
                "and collective sequence are the parent's)",
                rank=self.rank, path=self.url,
                hint="connect again in the child (ferrosync.connect(...) with the child's "
                "own rank and URL), or fork before connecting",
            )

    def _check_usable(self) -> None:
        """Raise unless a collective may start now: this process's, open, not failed."""
        self._check_process("a collective")
        if self._closed:
            raise SyncClosed("this GradSync is closed", rank=self.rank, path=self.url,
                             hint="connect again to start a new generation")
        if self._failure is not None:
            raise SyncClosed(
                f"an earlier collective failed ({type(self._failure).__name__}: "
                f"{self._failure})", rank=self.rank, path=self.url,
                hint="close this GradSync and connect again (all ranks)",
            )

    def _raise_if_failed(self, op: str) -> None:
        """For a backend about to publish inside collective ``op``: raise if this
        GradSync was failed meanwhile (by another thread's overlapping call, an exit
        hook), so that nothing more is published that peers could pair with the wrong
        call."""
        if self._failure is not None:
            raise self._failed_meanwhile(op)

    def _failed_meanwhile(self, op: str) -> FerrosyncError:
        failure = self._failure
        if failure is self._overlap and isinstance(failure, ConfigError):
            return ConfigError(
                f"{op} on thread {threading.current_thread().name!r} ran while another "
                f"thread called a collective on the same GradSync ({failure.what}); its "
                "result is discarded (the tensors hold undefined values)",
                rank=self.rank, path=self.url, hint=failure.hint,
            )
        return SyncClosed(
            f"this GradSync was failed from another thread while {op} ran "
            f"({type(failure).__name__}: {failure}); its result is discarded (the tensors "
            "hold undefined values)",
            rank=self.rank, path=self.url,
            hint="close this GradSync and connect again (all ranks)",
        )

    # -- failing and closing -------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
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
            _log.warning("rank %d: could not tell the peers this rank failed", self.rank,
                         exc_info=True)

    def _close_forked_copy(self) -> bool:
        """In a forked child: mark this copy closed, touching nothing of the parent's
        (handles, threads, objects), and return True; in the owner, return False."""
        if os.getpid() == self._pid:
            return False
        self._closed = True
        _LIVE.discard(self)
        return True

    def _forget(self) -> None:
        """Closed by its owner: the exit hooks no longer need to see it."""
        _LIVE.discard(self)


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
    for sync in list(_LIVE):
        if sync._pid == pid and sync._failure is None and not sync._closed:
            sync._fail(exc)


def _excepthook(exc_type, exc, tb):
    fail_open_syncs(exc)
    _previous_excepthook(exc_type, exc, tb)


def _close_all() -> None:
    pid = os.getpid()
    for sync in list(_LIVE):
        if sync._pid != pid:
            continue  # a forked child exiting must not publish "closed" for the parent
        try:
            sync.close()
        except Exception:  # noqa: BLE001 - at exit: one sync must not stop the others
            _log.warning("could not close %r at exit", sync, exc_info=True)


sys.excepthook = _excepthook
atexit.register(_close_all)
