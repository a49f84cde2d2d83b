"""``core/guard.py``: which process and which thread may run a ``GradSync``'s collective.

A small host stands for ``GradSync`` (it records the abort markers it would publish),
so each rule of the module is checked on its own: one thread inside a collective at a time
(a second one fails the GradSync, and the first one's result is discarded), the first
failure kept and told to the peers once, a forked child's copy that can neither run nor
fail nor close the parent's, closing (the shutdown runs once) and abandoning (a backend
whose ``__init__`` failed), and the exit hooks. Threads meet on events, never sleeps.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import pytest

from ferrosync.core import guard
from ferrosync.core.guard import OwnershipGuard, fail_open_syncs
from ferrosync.errors import ConfigError, SyncClosed


class Host:
    """What ``GradSync`` gives the guard: a rank, a URL, ``close`` and an abort marker
    (the ``publish_abort`` callback)."""

    rank = 2
    url = "mem://guarded"

    def __init__(self, abort_error: BaseException | None = None) -> None:
        self.aborts: list[BaseException] = []
        self.abort_error = abort_error
        self.closes = 0
        self.guard = OwnershipGuard(self, self.publish_abort)

    def publish_abort(self, exc):
        self.aborts.append(exc)
        if self.abort_error is not None:
            raise self.abort_error

    def close(self):
        self.closes += 1
        self.guard.close(lambda failure: None)


@pytest.fixture(autouse=True)
def live(monkeypatch):
    """The hooks' registry of open syncs, this test's own (others' GradSyncs stay out)."""
    registry = weakref.WeakSet()
    monkeypatch.setattr(guard, "_LIVE", registry)
    return registry


def _boom():
    raise ValueError("boom")


def test_a_collective_runs_on_the_calling_thread_and_may_nest():
    host = Host()
    seen = []

    def outer():
        seen.append((host.guard._owner, host.guard._owner_op, host.guard._depth))
        return host.guard.run("average", lambda: host.guard._depth)  # average_gradients -> average_

    assert host.guard.run("average_gradients", outer) == 2
    assert seen == [(threading.current_thread(), "average_gradients", 1)]
    assert (host.guard._owner, host.guard._depth) == (None, 0) and host.aborts == []


def test_a_failed_collective_is_told_once_and_every_later_call_refused():
    host = Host()
    with pytest.raises(ValueError, match="boom"):
        host.guard.run("broadcast", _boom)
    assert [str(e) for e in host.aborts] == ["boom"]
    ran = []
    with pytest.raises(SyncClosed, match=r"an earlier collective failed \(ValueError: boom\)") \
            as info:
        host.guard.run("average", lambda: ran.append(True))
    assert ran == [] and info.value.rank == 2 and info.value.path == "mem://guarded"
    assert "connect again (all ranks)" in info.value.hint
    assert len(host.aborts) == 1  # the first failure only


def test_a_closed_guard_refuses_collectives():
    host = Host()
    host.close()
    with pytest.raises(SyncClosed, match="this GradSync is closed"):
        host.guard.run("average", lambda: None)
    assert host.aborts == []  # closing is no failure


def test_an_abort_that_cannot_be_published_never_masks_the_error(caplog):
    host = Host(abort_error=OSError("disk full"))
    with caplog.at_level(logging.WARNING, logger="ferrosync.core.guard"):
        with pytest.raises(ValueError, match="boom"):
            host.guard.run("average", _boom)
    assert "rank 2: could not tell the peers this rank failed" in caplog.text


def _inside(host, op, body_end, results):
    """Run ``op`` on a new thread; its body signals ``inside`` and waits for ``body_end``."""
    inside = threading.Event()

    def body():
        inside.set()
        return body_end()

    def run():
        try:
            results.append(host.guard.run(op, body))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results.append(exc)

    thread = threading.Thread(target=run, name="worker")
    thread.start()
    assert inside.wait(10)
    return thread


def test_a_second_thread_that_overlaps_fails_the_sync_and_the_first_ones_result():
    host = Host()
    release, results = threading.Event(), []
    thread = _inside(host, "average", lambda: release.wait(10) and "tensors", results)
    with pytest.raises(ConfigError) as info:
        host.guard.run("broadcast", lambda: None)
    me = threading.current_thread().name
    assert (f"thread {me!r} called broadcast while thread 'worker' is inside average on the "
            "same GradSync") in str(info.value)
    assert "this GradSync is now failed" in info.value.hint
    release.set()
    thread.join(10)
    (first,) = results
    assert isinstance(first, ConfigError)  # completed, but perhaps paired with the other call
    assert "average on thread 'worker' ran while another thread called a collective" in str(
        first) and "result is discarded" in str(first)
    assert host.aborts == [info.value]  # the peers hear of the overlap once
    with pytest.raises(SyncClosed):
        host.guard.run("average", lambda: None)


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_a_failure_from_another_thread_discards_the_running_collectives_result(outcome):
    host = Host()
    release, results = threading.Event(), []

    def body_end():
        release.wait(10)
        if outcome == "raises":  # the fallout: state torn down under the collective
            raise RuntimeError("handle closed")
        return "tensors"

    thread = _inside(host, "average", body_end, results)
    fail_open_syncs(KeyboardInterrupt())  # e.g. the launcher ending the process
    with pytest.raises(SyncClosed, match="was failed from another thread while publish"):
        host.guard.raise_if_failed("publish")  # what a backend asks before it writes
    release.set()
    thread.join(10)
    (error,) = results
    assert isinstance(error, SyncClosed)
    assert "failed from another thread while average ran (KeyboardInterrupt" in str(error)
    assert len(host.aborts) == 1 and isinstance(host.aborts[0], KeyboardInterrupt)


def test_a_forked_childs_copy_cannot_run_fail_or_close_the_parents_sync(live):
    host = Host()
    parent = os.getpid() + 1
    host.guard._pid = parent  # as in a child forked after connect
    with pytest.raises(ConfigError, match=f"belongs to pid {parent}; this is pid "
                                          f"{os.getpid()}, a forked child, which cannot "
                                          "run average") as info:
        host.guard.run("average", lambda: None)
    assert "connect again in the child" in info.value.hint
    host.guard.fail(ValueError("the child failed"))
    fail_open_syncs(ValueError("the child exits"))
    guard._close_all()
    assert host.aborts == [] and host.closes == 0 and host.guard.failure is None
    assert host.guard.close_forked_copy() and host.guard.closed and host.guard not in live


def test_fail_open_syncs_fails_each_open_one_once(live):
    open_one, closed, failed = Host(), Host(), Host()
    closed.close()
    with pytest.raises(ValueError):
        failed.guard.run("average", _boom)
    assert set(live) == {open_one.guard, failed.guard}
    error = RuntimeError("the script failed")
    fail_open_syncs(error)
    assert open_one.aborts == [error] and closed.aborts == []
    assert [str(e) for e in failed.aborts] == ["boom"]  # its own failure, told already


def test_the_exit_hooks_fail_then_close_what_is_open(monkeypatch, live, caplog):
    seen = []
    monkeypatch.setattr(guard, "_previous_excepthook", lambda *args: seen.append(args))
    one, two = Host(), Host()
    error = RuntimeError("uncaught")
    guard._excepthook(RuntimeError, error, None)
    assert one.aborts == [error] and two.aborts == [error]
    assert seen == [(RuntimeError, error, None)]  # and the usual traceback still printed

    def broken_close():
        raise OSError("cannot close")

    monkeypatch.setattr(one, "close", broken_close)
    with caplog.at_level(logging.WARNING, logger="ferrosync.core.guard"):
        guard._close_all()
    assert two.closes == 1 and "could not close" in caplog.text  # one did not stop the other


def test_close_runs_the_shutdown_once_with_the_first_failure(live):
    host = Host()
    with pytest.raises(ValueError):
        host.guard.run("average", _boom)
    shutdowns = []
    host.guard.close(shutdowns.append)
    host.guard.close(shutdowns.append)  # idempotent
    assert [str(f) for f in shutdowns] == ["boom"] and host.guard.closed
    assert host.guard not in live


def test_an_abandoned_guard_refuses_collectives_and_the_exit_hook_skips_it(live):
    host = Host()  # as a backend whose __init__ failed after the guard was made
    host.guard.abandon()
    assert host.guard not in live
    guard._close_all()
    assert host.closes == 0 and host.guard.failure is None
    with pytest.raises(SyncClosed, match="this GradSync is closed"):
        host.guard.run("average", lambda: None)
