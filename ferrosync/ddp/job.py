"""Which job a ``"ferrosync"`` process group belongs to, told through torch's store.

Rank 0 draws a random job id and the other ranks read it from the key-value store
torch hands the backend, with a token handshake so a stale id left by a killed run is
never taken (``job_from_store``); subgroups inherit the default group's id. Why, and
where no shared store exists: docs/design.md#claim-window.
"""

from __future__ import annotations

import secrets
import time

from ferrosync.core import runtime
from ferrosync.ddp.init_methods import is_shared_store
from ferrosync.errors import SyncTimeout

#: the store keys, below the group's own prefix that torch adds
JOB_KEY = "ferrosync/job"
#: job ids drawn here look like this (``names.JOB_ID`` accepts them)
JOB_PREFIX = "torch-"


def _ack_key(job: str, rank: int) -> str:
    return f"ferrosync/ack/{job}/{rank}"


def _go_key(token: str) -> str:
    return f"ferrosync/go/{token}"


def _await_key(store, key: str, deadline: float, what: str, rank: int, *,
               give_up: float | None = None) -> bool:
    """Poll ``store.check([key])`` until it holds (True), ``give_up`` passes (False) or
    ``deadline`` passes (``SyncTimeout``)."""
    def expired() -> bool:
        if runtime.passed(deadline):
            raise SyncTimeout(f"timed out waiting for {what} in torch's store", rank=rank,
                              hint="start every rank of the group with the same "
                              "init_method, world size and timeout")
        return False  # ``give_up`` passed first

    return runtime.wait(lambda: True if store.check([key]) else None,
                        deadline=deadline if give_up is None else min(deadline, give_up),
                        expired=expired, poll=(0.0005, 0.05))


def job_from_store(store, rank: int, world_size: int, timeout: float) -> str:
    """Collective over the group's ranks: the job id rank 0 draws, read by every rank
    from ``store`` (see the module docstring). Raises ``SyncTimeout`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        job = JOB_PREFIX + secrets.token_hex(8)
        store.set(JOB_KEY, job)
        for peer in range(1, world_size):
            key = _ack_key(job, peer)
            _await_key(store, key, deadline, f"rank {peer} to read the job id", rank)
            store.set(_go_key(store.get(key).decode()), job)
        return job
    # one token for every id this rank answers: rank 0 answers it once, whichever of
    # this rank's acks it read, and the answer names the id it drew
    token = secrets.token_hex(8)
    answer = _go_key(token)
    acked, wait = None, 0.05
    while True:
        _await_key(store, JOB_KEY, deadline, "rank 0's job id", rank)
        job = store.get(JOB_KEY).decode()
        if job != acked:
            store.set(_ack_key(job, rank), token)
            acked = job
        if _await_key(store, answer, deadline, "rank 0's answer", rank,
                      give_up=time.monotonic() + wait):
            return store.get(answer).decode()
        wait = min(2 * wait, 1.0)  # a stale id (or a slow rank 0): read the id again


def group_job(store, rank: int, world_size: int, timeout: float, *,
              inherited: str | None = None) -> str | None:
    """The job id for a new group: ``inherited`` (a subgroup's parent's) if given, else
    one drawn through a shared ``store``; None where the store is this process's alone
    (the caller then uses the environment's id or the claim window)."""
    if inherited is not None:
        return inherited
    if world_size == 1 or not is_shared_store(store):
        return None
    return job_from_store(store, rank, world_size, timeout)


__all__ = ["JOB_KEY", "job_from_store", "group_job"]
