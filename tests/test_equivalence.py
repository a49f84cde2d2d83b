"""Training equivalence: torch DDP on gloo == ferrosync on gloo == ferrosync on a directory.

The same seeded model is trained for 24 optimizer steps on 2 ranks, each rank taking
its data shard from ``shard_indices``. Every run must be bit-identical across its
ranks, and the three runs must agree to rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import datetime

import torch

import ferrosync
from conftest import free_port
from ranks import run_ranks

STEPS = 24
BATCH = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH * 2, 10, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 5] > 0).long()) % 4
    return x, y


def train(rank, world, step_fn, model):
    x, y = make_data()
    indices = ferrosync.shard_indices(len(x), rank, world, shuffle=True, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        batch = indices[step * BATCH:(step + 1) * BATCH]
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        step_fn()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def w_torch_ddp(rank, world, port):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    try:
        return train(rank, world, lambda: None, model)
    finally:
        dist.destroy_process_group()


def w_ferrosync(rank, world, url):
    model = make_model()
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60) as sync:
        return train(rank, world, lambda: sync.average_gradients(model), model)


def test_ddp_and_ferrosync_train_the_same_model(tmp_path):
    runs = {
        "torch DDP (gloo)": run_ranks(w_torch_ddp, 2, free_port()),
        "ferrosync gloo": run_ranks(w_ferrosync, 2, f"gloo://127.0.0.1:{free_port()}"),
        "ferrosync directory": run_ranks(w_ferrosync, 2, str(tmp_path / "run")),
    }
    for name, per_rank in runs.items():
        for a, b in zip(per_rank[0], per_rank[1]):
            assert torch.equal(a, b), f"{name}: ranks differ"
    reference = runs["torch DDP (gloo)"][0]
    initial = list(make_model().parameters())
    for name, per_rank in runs.items():
        for got, want, init in zip(per_rank[0], reference, initial):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(got, init.detach())  # training moved the parameters
