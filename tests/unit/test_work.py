"""``ddp/work.py``: the torch ``Work`` objects of the ``"ferrosync"`` process group, in this
process without a process group.

``Done`` is complete when made; ``Pending`` completes from the async thread, and its
``wait`` and its future deliver the collective's typed error (the future's value stays the
tensors for torch's C++ side, its Python unwrap raises); ``Received`` reads the message
when first waited for, once. The process group that hands them out is tested through
torch in tests/test_ddp_*.py.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

from ferrosync.ddp.work import Done, Pending, Received
from ferrosync.errors import PeerFailed, SyncTimeout


def test_done_is_complete_with_its_result_and_a_set_future():
    tensors = [torch.arange(3.0)]
    work = Done(tensors)
    assert work.wait() and work.is_completed() and work.result() is tensors
    future = work.get_future()
    assert future.done() and future.wait() is tensors
    assert future.then(lambda f: f.value()[0].sum().item()).wait() == 3.0


def test_pending_completes_from_the_async_thread_with_its_tensors():
    tensors = [torch.ones(2)]
    work = Pending(tensors, rank=1, url="mem://run")
    assert not work.is_completed() and not work.is_success()
    finisher = threading.Thread(target=work.finish, args=(None,))
    finisher.start()
    assert work.wait()  # no timeout: until it finished
    finisher.join(10)
    assert work.is_completed() and work.is_success() and work.result() is tensors
    assert work.get_future().wait() is tensors


def test_a_pending_wait_with_a_timeout_names_it_and_leaves_the_work_running():
    work = Pending([torch.ones(1)], rank=3, url="mem://run")
    with pytest.raises(SyncTimeout, match=r"did not finish within the wait's 0.001 s timeout "
                                          r"\(it keeps running\)") as info:
        work.wait(datetime.timedelta(milliseconds=1))
    assert (info.value.rank, info.value.path) == (3, "mem://run")
    work.finish(None)
    assert work.wait(datetime.timedelta(seconds=5))


def test_a_failed_pending_work_raises_its_typed_error_from_wait_and_future():
    tensors = [torch.ones(2)]
    work = Pending(tensors, rank=0, url="mem://run")
    error = PeerFailed("rank 1 failed at collective 4", rank=0, collective=4)
    seen = []
    chained = work.get_future().then(lambda f: seen.append(_outcome(f)))
    work.finish(error)
    assert work.is_completed() and not work.is_success()
    with pytest.raises(PeerFailed) as info:
        work.wait()
    assert info.value is error
    with pytest.raises(PeerFailed):
        work.result()
    with pytest.raises(PeerFailed):
        work.get_future().wait()
    chained.wait()
    assert seen == [error]  # a `then` callback sees the error, typed


def _outcome(future):
    try:
        return future.value()
    except BaseException as exc:  # noqa: BLE001 - the test compares it
        return exc


class Receive:
    """A posted receive (``api.Receive``): ``wait`` reads the message, ``done`` looks."""

    def __init__(self, arrived: bool, src: int | None = 2) -> None:
        self.arrived, self.src, self.waits = arrived, src, 0

    def wait(self):
        self.waits += 1
        return self.src

    def done(self):
        return self.arrived


def test_a_received_message_is_read_on_the_first_wait_and_its_future_set_once():
    tensors = [torch.zeros(4)]
    receive = Receive(arrived=False)
    work = Received(receive, tensors)
    assert not work.is_completed() and not work.is_success()
    assert receive.waits == 0  # a look never blocks
    assert work.wait() and work.wait()
    assert work.result() is tensors and work.get_future().wait() is tensors
    assert work._source_rank() == 2  # torch asks after a receive from any source
    receive.arrived = True
    assert work.is_completed() and work.is_success()
