"""The canonical DistributedDataParallel script, run three ways.

    python examples/ddp_train.py --transport gloo                      # stock torch
    python examples/ddp_train.py --transport ferrosync --location /tmp/ddp-run
    python examples/ddp_train.py --transport hook --location s3://bucket/ddp-run

``gloo`` is the tutorial script as everyone writes it. ``ferrosync`` changes two
lines: ``import ferrosync`` and ``init_process_group("ferrosync", init_method=<dir
or URL>)``; gradients, buffers and ``all_reduce`` then travel through that
directory or bucket, with no network between the ranks. ``hook`` skips
``init_process_group`` entirely: ``model = ferrosync.ddp.wrap(model, sync)``.

By default ``--nproc 2`` local processes are started (``torch.multiprocessing.spawn``).
Under torchrun, one process per rank, pass the location explicitly:

    torchrun --nproc-per-node 2 examples/ddp_train.py --transport ferrosync --location /tmp/r

Every rank prints its final loss and a digest of its parameters; ``--save PREFIX``
writes ``PREFIX.rank<r>.pt`` for comparing the three transports (they agree to
float rounding). Object stores take credentials from the environment, or options
as JSON in ``FERROSYNC_PG_OPTIONS`` (e.g. ``{"storage_options": {"endpoint_url": ...}}``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ferrosync  # registers the "ferrosync" backend (not needed for --transport gloo)


def make_dataset(seed: int) -> TensorDataset:
    """A learnable synthetic classification task (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 20, generator=g)
    w = torch.randn(20, 5, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 5))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    model = make_model()
    sync = None
    if args.transport == "gloo":
        if "://" in args.location:
            raise SystemExit("--transport gloo needs a local or NFS directory as --location")
        # torch's FileStore waits its whole timeout (300 s) on a missing directory
        os.makedirs(args.location, exist_ok=True)
        store = os.path.join(args.location, "gloo.store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size)
        model = DDP(model)
    elif args.transport == "ferrosync":
        dist.init_process_group("ferrosync", init_method=args.location, rank=rank,
                                world_size=world_size)
        model = DDP(model)
    else:  # hook: no process group, DDP's collectives go through `sync`
        sync = ferrosync.connect(args.location, rank=rank, world_size=world_size)
        model = ferrosync.ddp.wrap(model, sync)

    dataset = make_dataset(args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(y), len(y)])
        if sync is None:
            dist.all_reduce(total)  # epoch loss over every rank
        else:
            sync.average_(total)  # (a sum's ratio equals the average's ratio)
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0] / total[1]:.4f}", flush=True)

    print(f"rank {rank}: final loss {total[0] / total[1]:.6f}, params {digest(model)}",
          flush=True)
    if args.save:
        torch.save(model.module.state_dict(), f"{args.save}.rank{rank}.pt")
    if sync is None:
        dist.destroy_process_group()
    else:
        sync.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=["gloo", "ferrosync", "hook"], required=True,
                        help="gloo: stock torch; ferrosync: init_process_group('ferrosync'); "
                        "hook: ferrosync.ddp.wrap with no process group")
    parser.add_argument("--location", default=None,
                        help="directory or fsspec URL shared by every rank (default: a new "
                        "temporary directory; required under torchrun)")
    parser.add_argument("--nproc", type=int, default=2,
                        help="local processes to start (ignored under torchrun)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="model, data and sampler seed")
    parser.add_argument("--save", default=None,
                        help="write each rank's final state_dict to SAVE.rank<r>.pt")
    args = parser.parse_args()

    if "RANK" in os.environ:  # torchrun: this process is one rank
        if args.location is None:
            parser.error("--location is required under torchrun (every rank must share it)")
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    with tempfile.TemporaryDirectory(prefix="ddp-example-") as tmp:
        if args.location is None:
            args.location = tmp
        mp.spawn(train, args=(args.nproc, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
