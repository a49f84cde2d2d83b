"""The ``"ferrosync"`` process group under inference mode, and object collectives
without a secret.

* Every collective works on tensors made under ``torch.inference_mode()`` (Lightning's
  test and validation loops), on the overlapped allreduce path (a library thread,
  where inference mode is off) and the synchronous one, with gloo's results; the group
  stays usable outside inference mode afterwards.
* The first object collective on a group without a secret warns once per process,
  saying what a storage writer could do and how to set a secret; with a secret it
  does not warn, and tensor collectives never do; every storage backend (flat,
  elastic, two-level) tells the warning whether its objects carry a MAC.
"""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

import ferrosync
from ranks import run_ranks

TIMEOUT = datetime.timedelta(seconds=60)
Op = dist.ReduceOp


def w_inference(rank, world, backend, location, options):
    kwargs = {"pg_options": options} if backend == "ferrosync" else {}
    dist.init_process_group(backend, init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT, **kwargs)
    out = {}
    try:
        with torch.inference_mode():
            base = torch.arange(1, 7, dtype=torch.float32) * (rank + 1)
            assert base.is_inference()
            for op in ("SUM", "AVG", "MAX"):
                t = base.clone()
                dist.all_reduce(t, op=getattr(Op, op))
                out[f"all_reduce.{op}"] = t.clone()
            t = base.clone()
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            out["all_reduce.async"] = t.clone()
            ints = torch.tensor([rank + 1, 7], dtype=torch.int64)
            dist.all_reduce(ints, op=Op.MAX)
            out["all_reduce.int64.MAX"] = ints.clone()
            t = base.clone()
            dist.broadcast(t, src=world - 1)
            out["broadcast"] = t.clone()
            parts = [torch.empty(6) for _ in range(world)]
            dist.all_gather(parts, base)
            out["all_gather"] = torch.stack(parts)
            whole = torch.empty(6 * world)
            dist.all_gather_into_tensor(whole, base)
            out["all_gather_into_tensor"] = whole.clone()
            shard = torch.empty(3)
            dist.reduce_scatter_tensor(shard, torch.arange(3.0 * world) * (rank + 1))
            out["reduce_scatter_tensor"] = shard.clone()
            t = base.clone()
            dist.reduce(t, dst=0)
            out["reduce"] = t.clone() if rank == 0 else None  # gloo leaves others' partial
            gathered = [torch.empty(6) for _ in range(world)] if rank == 0 else None
            dist.gather(base, gathered, dst=0)
            out["gather"] = torch.stack(gathered) if rank == 0 else None
            t = torch.empty(2)
            dist.scatter(t, [torch.full((2,), 10.0 + j) for j in range(world)]
                         if rank == 0 else None, src=0)
            out["scatter"] = t.clone()
            dist.barrier()
        # outside inference mode again: the group (and its pooled buffers) still work
        t = torch.ones(6) * (rank + 1)
        dist.all_reduce(t)
        out["after"] = t
    finally:
        dist.destroy_process_group()
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_every_collective_works_on_inference_tensors_like_gloo(tmp_path, overlap):
    gloo = run_ranks(w_inference, 2, "gloo", f"file://{tmp_path / 'gloo-store'}", None)
    ours = run_ranks(w_inference, 2, "ferrosync", str(tmp_path / "run"),
                     {"overlap": overlap})
    for rank in range(2):
        assert ours[rank].keys() == gloo[rank].keys()
        for name, want in gloo[rank].items():
            got = ours[rank][name]
            if want is None:
                assert got is None
            else:
                assert torch.equal(got, want), (rank, name, got, want)


def w_objects(rank, world, location, options):
    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT, pg_options=options)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = torch.ones(2)
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            tensors_only = len(caught)
            objects = [None] * world
            dist.all_gather_object(objects, {"rank": rank})
            shared = [rank, "x"]
            dist.broadcast_object_list(shared, src=1)
            dist.all_gather_object(objects, {"rank": rank})
    finally:
        dist.destroy_process_group()
    ours = [str(w.message) for w in caught if type(w.message).__name__
            == "ObjectCollectiveWarning"]
    return tensors_only, ours, objects, shared


def test_object_collectives_without_a_secret_warn_once_per_process(tmp_path, monkeypatch):
    monkeypatch.delenv("FERROSYNC_SECRET", raising=False)
    results = run_ranks(w_objects, 2, str(tmp_path / "run"), None)
    for rank, (tensors_only, warned, objects, shared) in enumerate(results):
        assert objects == [{"rank": 0}, {"rank": 1}] and shared == [1, "x"]
        assert tensors_only == 0
        assert len(warned) == 1, warned  # three object collectives, one warning
        (text,) = warned
        assert text.startswith(f"rank {rank}: all_gather_object on the ferrosync process group")
        assert "run code in every rank" in text and "FERROSYNC_SECRET" in text


def test_object_collectives_with_a_secret_do_not_warn(tmp_path):
    results = run_ranks(w_objects, 2, str(tmp_path / "run"), {"secret": "s3cret"})
    assert [warned for _, warned, _, _ in results] == [[], []]


@pytest.mark.parametrize("secret", [None, "s3cret"])
@pytest.mark.parametrize("backend", ["storage", "elastic", "hierarchical"])
def test_every_storage_backend_says_whether_its_objects_are_authenticated(tmp_path, backend,
                                                                         secret):
    """What the warning asks (``GradSync.unauthenticated_storage``): True for each backend
    that moves bytes through storage without a secret, False with one."""
    options = {"secret": secret} if secret else {}
    kind = {"storage": {"rank": 0, "world_size": 1},
            "elastic": {"elastic": True, "min_ranks": 1},
            "hierarchical": {"rank": 0, "world_size": 1, "local": "gloo"}}[backend]
    with ferrosync.connect(str(tmp_path / "run"), timeout=30, **kind, **options) as sync:
        assert sync.unauthenticated_storage is (secret is None)
