"""torch ``Work`` objects of the ``"ferrosync"`` process group: ``Done`` for the
synchronous collectives, ``Pending`` for an allreduce running on the GradSync's async
thread (its ``wait`` and future deliver the collective's typed error), ``Received`` for
a posted receive (``irecv``: its ``wait`` reads the message)."""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist
from torch.futures import Future

from ferrosync.errors import SyncTimeout

__all__ = ["Done", "Pending", "Received"]


class Done(dist._Work):
    """A Work that is complete when it is created (every collective but ``allreduce``
    is synchronous)."""

    def __init__(self, result) -> None:
        super().__init__()
        self._result = result
        self._future = Future()
        self._future.set_result(result)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self):
        return self._result

    def get_future(self) -> Future:
        return self._future


class Pending(dist._Work):
    """An allreduce running on the GradSync's async thread.

    ``wait()`` blocks until it finished and raises its typed error. The future
    completes from the async thread, always with the tensors as far as torch's C++
    is concerned (DDP's reducer reads the value as tensors, and crashes on an
    exception object); on failure its Python unwrap function raises the error, so
    ``get_future().wait()`` / ``.value()`` and ``then`` callbacks see it, typed.
    """

    def __init__(self, result, rank: int, url: str) -> None:
        super().__init__()
        self._result = result
        self._rank, self._url = rank, url
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._future = Future()

    @property
    def failure(self) -> BaseException | None:
        """The error it ended with (None while running or after a success)."""
        return self._error

    def finish(self, error: BaseException | None) -> None:
        """On the async thread: record the outcome, then complete the future."""
        self._error = error
        if error is not None:
            def raise_error(_value, error=error):
                raise error

            self._future._set_unwrap_func(raise_error)
        self._event.set()
        self._future.set_result(self._result)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._event.wait(seconds if seconds > 0 else None):
            raise SyncTimeout(f"allreduce did not finish within the wait's {seconds} s "
                              "timeout (it keeps running)", rank=self._rank, path=self._url)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def settle(self) -> None:
        """Block until it finished, raising nothing (its error stays in ``failure``);
        the collective's own timeout bounds the wait."""
        self._event.wait()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def result(self):
        self.wait()
        return self._result

    def get_future(self) -> Future:
        return self._future


class Received(dist._Work):
    """A posted receive (``GradSync.irecv``'s ``Receive``): the message is chosen when
    posted and read by ``wait`` (or a successful ``is_completed``), so a receive never
    blocks the calls after it. ``_source_rank`` is the sender's rank (torch reads it
    after ``recv`` from any source)."""

    def __init__(self, receive, tensors) -> None:
        super().__init__()
        self._receive = receive
        self._tensors = tensors
        self._future = Future()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._receive.wait()
        if not self._future.done():
            self._future.set_result(self._tensors)
        return True

    def is_completed(self) -> bool:
        if self._receive.done():
            return self.wait()
        return False

    def is_success(self) -> bool:
        return self.is_completed()

    def _source_rank(self) -> int:
        self.wait()
        return self._receive.src

    def result(self):
        self.wait()
        return self._tensors

    def get_future(self) -> Future:
        self.wait()
        return self._future
