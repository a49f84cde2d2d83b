"""A job launched through torch tells its ranks apart through torch's store: no claim window.

``ferrosync.ddp.job``: rank 0 draws the job id, the others read it from the store torch
hands the backend, answered so that a stale store (a FileStore left by a killed run)
cannot hand them an old id. Subgroups inherit the default group's id.
"""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch.distributed as dist

from ferrosync.ddp import job
from ferrosync.ddp.init_methods import EnvStore, UrlStore
from ranks import run_ranks


def _both(store, world=2):
    out, errors = {}, []

    def rank(r):
        try:
            out[r] = job.job_from_store(store, r, world, 10.0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(world))]
    for t in threads:
        t.start()
    return threads, out, errors


@pytest.mark.unit
def test_every_rank_reads_rank_0s_fresh_id():
    threads, out, errors = _both(dist.PrefixStore("g/", dist.HashStore()), world=3)
    for t in threads:
        t.join(15)
    assert not errors
    assert len(set(out.values())) == 1 and out[0].startswith(job.JOB_PREFIX)


@pytest.mark.unit
def test_a_stale_id_in_the_store_is_not_taken():
    store = dist.HashStore()
    # what a killed run left: its id, and a rank's answer to it
    stale = dist.PrefixStore("g/", store)
    stale.set(job.JOB_KEY, "torch-0000000000000000")
    stale.set("ferrosync/ack/torch-0000000000000000/1", "feedfacefeedface")
    out, errors = {}, []

    def late_rank_0():
        # rank 1 reads the stale id first; rank 0 of this run writes the fresh one later
        while not stale.check(["ferrosync/ack/torch-0000000000000000/1"]) or \
                stale.get("ferrosync/ack/torch-0000000000000000/1") == b"feedfacefeedface":
            threading.Event().wait(0.01)
        out[0] = job.job_from_store(dist.PrefixStore("g/", store), 0, 2, 10.0)

    def rank_1():
        try:
            out[1] = job.job_from_store(dist.PrefixStore("g/", store), 1, 2, 10.0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank_1), threading.Thread(target=late_rank_0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors
    assert out[0] == out[1] != "torch-0000000000000000"


class _SlowAnswers(dist.Store):
    """A shared store whose answers (``ferrosync/go/...``) take a while to be written."""

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()

    def set(self, key, value):
        if key.startswith("ferrosync/go/"):
            threading.Event().wait(0.4)  # rank 1 gives up waiting and reads the id again
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def check(self, keys):
        return self.inner.check(keys)


@pytest.mark.unit
def test_a_slow_rank_0_answers_the_token_rank_1_waits_for():
    threads, out, errors = _both(_SlowAnswers())
    for t in threads:
        t.join(15)
    assert not errors and out[0] == out[1]


@pytest.mark.unit
def test_a_missing_rank_0_is_a_timeout():
    from ferrosync.errors import SyncTimeout

    with pytest.raises(SyncTimeout, match="rank 0's job id"):
        job.job_from_store(dist.HashStore(), 1, 2, 0.2)


@pytest.mark.unit
def test_process_local_stores_give_no_id():
    assert job.group_job(UrlStore("s3://b/p", 0), 0, 2, 1.0) is None
    assert job.group_job(dist.PrefixStore("x/", EnvStore(1)), 1, 2, 1.0) is None
    assert job.group_job(dist.HashStore(), 0, 2, 1.0, inherited="parent") == "parent"


def short_timeouts(rank, world, init_method):
    os.environ.pop("FERROSYNC_JOB", None)
    import ferrosync  # noqa: F401
    from ferrosync.ddp import stats
    from ferrosync.ddp.process_group import sync_of

    dist.init_process_group("ferrosync", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=2))
    try:
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=1))
        import torch

        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=group)
        world_job = sync_of(dist.distributed_c10d._get_default_group()).job
        return world_job, sync_of(group).job, t.tolist(), stats(group)["total"]["collectives"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spelling", ["directory", "file", "env"])
def test_short_timeouts_without_a_job_id(tmp_path, spelling):
    """init_process_group(timeout=2s) and new_group(timeout=1s) without FERROSYNC_JOB:
    before, both always failed in the 3 s claim window."""
    env = {}
    if spelling == "directory":
        init = str(tmp_path / "run")
    elif spelling == "file":
        init = f"file://{tmp_path}/store"
    else:
        from conftest import free_port

        init = "env://"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(),
               "FERROSYNC_URL": str(tmp_path / "run")}
    results = run_ranks(short_timeouts, 2, init, env=env, timeout=60)
    jobs = {r[0] for r in results} | {r[1] for r in results}
    assert len(jobs) == 1 and jobs.pop().startswith(job.JOB_PREFIX)
    assert all(r[2] == [3.0, 3.0, 3.0] for r in results)
