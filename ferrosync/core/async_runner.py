"""The async runner: ``SyncHandle`` and the one thread that runs submitted collectives.

Contract: a ``GradSync`` has at most one ``AsyncRunner``, started by its first
``async_op=True`` call (or ``GradSync.submit``). It runs what is submitted one at a
time, in submission order, on one daemon thread; each submission gets a
``SyncHandle`` that carries its value or its error. The runner knows nothing of
collectives: what it runs is a function that enters the ownership guard
(``core/guard.py``) like any caller, and a call from another thread first waits for
everything submitted (``drain``), so submitted and direct calls keep call order.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

__all__ = ["SyncHandle", "AsyncRunner", "RUNNER_JOIN_TIMEOUT"]

#: how long close() waits for the async thread to finish its queue (seconds)
RUNNER_JOIN_TIMEOUT = 10.0


class SyncHandle(concurrent.futures.Future):
    """The pending result of a collective started with ``async_op=True``: a
    ``concurrent.futures.Future`` (``done()``, ``result()``, ``exception()``,
    ``add_done_callback``, ``concurrent.futures.wait``) plus ``wait()``.

    It cannot be cancelled: the peers run the collective whatever this rank wants, so
    skipping it would pair every later call with the wrong one (``cancel()`` returns
    False).
    """

    def cancel(self) -> bool:
        return False

    def wait(self, timeout: float | None = None):
        """Block until the collective finished; return its value or raise its error.

        ``timeout`` bounds this wait only (the collective keeps its own timeout); past
        it, ``TimeoutError``.
        """
        try:
            return self.result(timeout)
        except concurrent.futures.TimeoutError:
            if self.done():
                raise  # the collective itself raised a TimeoutError
            raise TimeoutError(
                f"the async collective did not finish within {timeout} s") from None


class AsyncRunner:
    """One daemon thread running submitted functions in order.

    A daemon thread, so a process whose peers vanished can still exit; the
    collective's own timeout bounds how long a running one can take.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[SyncHandle] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn) -> SyncHandle:
        """Queue ``fn`` after every earlier submission; its handle gets its result."""
        handle = SyncHandle()
        self._pending.append(handle)
        self._queue.put((fn, handle))
        return handle

    def is_worker(self) -> bool:
        """Whether the calling thread is this runner's own."""
        return threading.current_thread() is self._thread

    def drain(self) -> None:
        """Wait for every submitted function (errors stay with their handles)."""
        concurrent.futures.wait(self._pending)
        self._pending = [h for h in self._pending if not h.done()]

    def stop(self) -> None:
        """Let the thread end after what is queued (which fails fast once closed)."""
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the thread to finish (after ``stop``)."""
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, handle = item
            handle.set_running_or_notify_cancel()  # never cancelled (SyncHandle.cancel)
            try:
                handle.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered by handle.wait()
                handle.set_exception(exc)
