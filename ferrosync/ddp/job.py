"""Which job a ``"ferrosync"`` process group belongs to, told through torch's store.

Two jobs on one storage URL must never meet. ``connect`` tells them apart by a job id
(``FERROSYNC_JOB``, SLURM's or torchelastic's); a job without one waits a claim window
(3 s, ``ferrosync.storage.rendezvous``) so that a second job starting at the same moment is
seen. A job launched through torch needs neither: torch hands the backend factory a
key-value store (``env://``'s and ``tcp://``'s TCPStore, ``file://``'s FileStore, a
given ``store=``) that only this job's ranks share, so rank 0 draws a random job id
and the others read it there (``job_from_store``). The storage rendezvous then runs in
that job's own namespace (``rdzv.torch-<16 hex>/``), without a claim window.

A store can outlive its job (a FileStore file left by a killed run, which torch
itself asks users to delete): a rank must not take a stale id for this run's. So
every rank r > 0 answers the id it read with a token of its own
(``ferrosync/ack/<id>/<r>``), and only rank 0 of this run, which drew that id, answers
that token (``ferrosync/go/<token>``, naming the id); a rank that read a stale id gets
no answer, reads the id again and answers the fresh one, with the same token, once
rank 0 has written it. Every wait
polls ``check`` (which never blocks) within the group's timeout.

Subgroups (``new_group``) inherit the id of the default group when it is a
``"ferrosync"`` group (their files live in ``<location>/group.<name>``, a namespace
of their own), so they cost what gloo's do; any other group draws its own.
Process-local stores (``init_methods.UrlStore``, ``EnvStore``: an object-store URL, or
``env://`` without ``MASTER_ADDR``) are shared with no other rank: there the job id
comes from the environment or the claim window applies, as for ``ferrosync.connect``.
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
