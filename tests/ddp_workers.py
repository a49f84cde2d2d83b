"""Rank functions for the DDP tests: a tutorial-style training loop and collective checks.

Each function runs on a real process started by ``ranks.run_ranks`` and returns
what the test compares (parameters, collective results). ``gloo_reference`` runs
the same loop on stock gloo once per configuration and caches the result for the
test session.
"""

from __future__ import annotations

import datetime
import tempfile
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ferrosync
from ranks import run_ranks

TIMEOUT = datetime.timedelta(seconds=60)
FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}  # dead peers noticed in ~2 s
MODES = ("gloo", "ferrosync", "wrap", "hook-local")


class Net(nn.Module):
    """A small classifier with BatchNorm (buffers DDP broadcasts every forward) and,
    optionally, a parameter the forward never uses (needs find_unused_parameters)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                  nn.Linear(32, 4))
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.body(x)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(96, 8, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return TensorDataset(x, y)


def _setup(mode, rank, world, location, unused, options):
    """(ddp model, plain model, sync or None) for one way of running DDP."""
    sync = None
    if mode == "gloo":
        dist.init_process_group("gloo", init_method=location, rank=rank, world_size=world,
                                timeout=TIMEOUT)
    elif mode == "ferrosync":
        dist.init_process_group("ferrosync", init_method=location, rank=rank,
                                world_size=world, timeout=TIMEOUT, pg_options=options)
    elif mode in ("wrap", "hook-local"):
        sync = ferrosync.connect(location, rank=rank, world_size=world, timeout=60.0,
                                 **(options or {}))
    else:  # pragma: no cover
        raise AssertionError(mode)
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = Net(unused)
    if mode == "wrap":
        ddp = ferrosync.ddp.wrap(model, sync, find_unused_parameters=unused)
    elif mode == "hook-local":
        # DDP over a per-process world of one: no network between ranks at all; the
        # hook does the real averaging through storage
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ddp = DistributedDataParallel(model, find_unused_parameters=unused)
        ddp.register_comm_hook(sync, ferrosync.ddp.hook)
    else:
        ddp = DistributedDataParallel(model, find_unused_parameters=unused)
    return ddp, model, sync


def train(rank, world, mode, location, *, steps=20, unused=False, options=None, fail=None):
    """The canonical loop: DistributedSampler, DDP, SGD with momentum, ``steps`` steps.

    ``fail=(rank, step)`` makes that rank raise just before that step's backward.
    Returns (state_dict clone, number of ferrosync collectives this rank ran).
    """
    ddp, model, sync = _setup(mode, rank, world, location, unused, options)
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    step = epoch = 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(ddp(x), y)
            if fail == (rank, step):
                raise RuntimeError(f"injected failure on rank {rank} at step {step}")
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if sync is None and mode == "ferrosync":
        sync = dist.group.WORLD.sync
    collectives = sync.stats["total"]["collectives"] if sync is not None else 0
    if dist.is_initialized():
        dist.destroy_process_group()
    if sync is not None:
        sync.close()
    return state, collectives


RTOL, ATOL = 1e-5, 1e-6  # the tolerance against DDP on gloo


def assert_matches_reference(results, reference, *, keys=None):
    """Every rank's final state equals gloo's to RTOL/ATOL, and ranks agree exactly."""
    for rank, ((state, count), (ref, _)) in enumerate(zip(results, reference)):
        assert count > 0, f"rank {rank} ran no ferrosync collective"
        for key in keys or ref:
            torch.testing.assert_close(state[key], ref[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")
    first = results[0][0]
    for rank, (state, _) in enumerate(results[1:], 1):
        for key in keys or first:
            if ".running_" in key:
                continue  # each rank's last forward updates its own running stats
            assert torch.equal(state[key], first[key]), f"rank {rank} differs from 0 at {key}"
    # training moved the weights: the comparison above is not between two initial states
    torch.manual_seed(0)
    initial = Net().state_dict()["body.0.weight"]
    assert not torch.allclose(results[0][0]["body.0.weight"], initial, atol=1e-3)


_REFERENCES: dict = {}


def gloo_reference(world: int, *, steps: int = 20, unused: bool = False) -> list:
    """Per-rank results of ``train`` on gloo (a FileStore in a temp dir), cached."""
    key = (world, steps, unused)
    if key not in _REFERENCES:
        with tempfile.TemporaryDirectory() as tmp:
            _REFERENCES[key] = run_ranks(train, world, "gloo", f"file://{tmp}/gloo.store",
                                         steps=steps, unused=unused)
    return _REFERENCES[key]


# -- collectives on the registered backend --------------------------------------------------

Op = dist.ReduceOp


def _all_reduces(rank: int, base: torch.Tensor, ints: torch.Tensor) -> dict:
    """all_reduce with every op on every dtype, non-contiguous, complex and async."""
    out = {}
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = base.clone()
        dist.all_reduce(t, op=getattr(Op, op))
        out[f"float32.{op}"] = t
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        for op in ("SUM", "AVG"):
            t = base.to(dtype)
            dist.all_reduce(t, op=getattr(Op, op))
            out[f"{str(dtype)[6:]}.{op}"] = t
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"):
        t = ints.clone()
        dist.all_reduce(t, op=getattr(Op, op))
        out[f"int64.{op}"] = t
    t = ints.to(torch.int32)
    dist.all_reduce(t)
    out["int32.SUM"] = t
    # non-contiguous and complex tensors, and an async handle
    t = (torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)).t()
    dist.all_reduce(t)
    out["noncontiguous.SUM"] = t
    t = torch.tensor([1 + 2j, -1j], dtype=torch.complex64) * (rank + 1)
    dist.all_reduce(t)
    out["complex64.SUM"] = t
    t = base.clone()
    work = dist.all_reduce(t, op=Op.AVG, async_op=True)
    assert work.wait() and work.is_completed()
    out["async.AVG"] = work.get_future().wait()[0]
    return out


def _tensor_collectives(rank: int, world: int, ints: torch.Tensor) -> dict:
    """all_gather, reduce_scatter, broadcast, reduce, gather and scatter of tensors."""
    out = {}
    gathered = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, 10 * rank]))
    out["all_gather"] = torch.stack(gathered)
    # torch 2.13 renamed these (the old names warn); older versions only have the old ones
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                             or dist.reduce_scatter_tensor)
    flat = torch.empty(2 * world)
    all_gather_single(flat, torch.tensor([rank, -rank], dtype=torch.float32))
    out["all_gather_into_tensor"] = flat
    shard = torch.empty(2)
    reduce_scatter_single(shard, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
    out["reduce_scatter_tensor"] = shard
    shard = torch.empty(2, dtype=torch.int64)
    dist.reduce_scatter(shard, [torch.full((2,), 10 * j + rank) for j in range(world)],
                        op=Op.MAX)
    out["reduce_scatter.MAX"] = shard
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=world - 1)
    out["broadcast"] = t
    t = ints.clone()
    dist.reduce(t, dst=1, op=Op.SUM)
    out["reduce"] = t
    gather_list = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([rank, rank + 0.5]), gather_list, dst=0)
    out["gather"] = torch.stack(gather_list) if rank == 0 else None
    t = torch.empty(3)
    scatter_list = [torch.full((3,), 100.0 + j) for j in range(world)] if rank == 0 else None
    dist.scatter(t, scatter_list, src=0)
    out["scatter"] = t
    return out


def _object_collectives(rank: int, world: int) -> dict:
    """all_gather_object (uneven sizes) and broadcast_object_list, then a barrier."""
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "pad": "x" * (100 * rank)})  # uneven sizes
    shared = [rank, f"from rank {rank}", {"nested": [rank] * 3}]
    dist.broadcast_object_list(shared, src=world - 1)
    dist.barrier()
    return {"all_gather_object": objects, "broadcast_object_list": shared}


def _bad_calls(rank: int, world: int, base: torch.Tensor, ints: torch.Tensor) -> dict:
    """Bad calls raise ConfigError before any I/O and leave the group usable."""
    errors = []
    for bad in (lambda: dist.all_reduce(ints.bool(), op=Op.AVG),  # integer AVG works
                lambda: dist.all_reduce(base.clone(), op=Op.BAND),
                lambda: dist.send(base, dst=(rank + 1) % world, tag=-1)):  # gloo's rule
        try:
            bad()
        except ValueError as exc:  # ConfigError
            errors.append(type(exc).__name__)
    t = base.clone()
    dist.all_reduce(t, op=Op.MAX)
    return {"errors": errors, "after_errors.MAX": t}


def collectives(rank, world, location, options=None):
    """Every collective the backend offers, with inputs the test can predict.

    Returns {name: result} (tensors and objects) for the test to check and compare
    across ranks; raises if a bad call does not raise ``ConfigError`` or leaves
    the group unusable.
    """
    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT, pg_options=options)
    base = torch.arange(1, 7, dtype=torch.float32) * (rank + 1)
    ints = torch.tensor([rank + 1, 3 * rank, -rank, 7, 1 << rank], dtype=torch.int64)
    out = _all_reduces(rank, base, ints)
    out.update(_tensor_collectives(rank, world, ints))
    out.update(_object_collectives(rank, world))
    out.update(_bad_calls(rank, world, base, ints))

    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=sub)
        out["subgroup.SUM"] = t
    out["backend"] = dist.get_backend()
    world_sync = dist.group.WORLD.sync
    dist.destroy_process_group()
    out["closed_after_destroy"] = world_sync.guard.closed
    out["threads_left"] = [t.name for t in threading.enumerate() if "ferrosync" in t.name]
    return out


class TwoParams(nn.Module):
    """Parameters of the given shapes; the loss touches all of them."""

    def __init__(self, *shapes) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.ones(s)) for s in shapes)

    def forward(self, x):
        return sum(p.sum() for p in self.params) * x.sum()


def mismatched_buckets(rank, world, location):
    """Ranks whose DDP buckets have the same size but different parameter shapes, over
    per-process world-size-1 gloo groups with the hook doing the averaging."""
    sync = ferrosync.connect(location, rank=rank, world_size=world, timeout=60.0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = TwoParams((6, 4), (6,)) if rank == 0 else TwoParams((4, 6), (6,))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(sync, ferrosync.ddp.hook)
    try:
        ddp(torch.ones(2)).backward()
    finally:
        dist.destroy_process_group()
        sync.close()


def init_without_location(rank, world, url_env):
    """init_process_group("ferrosync") over a store that names no location; returns
    the location the group ended up using (``FERROSYNC_URL``) or raises ConfigError."""
    if url_env:
        import os

        os.environ["FERROSYNC_URL"] = url_env
    dist.init_process_group("ferrosync", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        return dist.group.WORLD.sync.url, t
    finally:
        dist.destroy_process_group()
