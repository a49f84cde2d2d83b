"""Time a DDP training step on gloo, the "ferrosync" backend and the ferrosync comm hook.

    python tools/bench_ddp.py                           # 2 ranks, ~4M parameters, local temp dir
    python tools/bench_ddp.py --nproc 3 --params 16 --steps 30 --location /mnt/nfs/bench

Each transport runs the same model (an MLP with about ``--params`` million float32
parameters) and batch on every rank; after ``--warmup`` steps it times ``--steps``
optimizer steps and prints one line per transport: median and p90 step time, and
the gradient bytes per step (parameters x 4). ferrosync collectives are
synchronous, so DDP cannot overlap them with the backward pass; the gap to gloo
is the cost of that plus the storage round trips.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ferrosync


def make_model(million: float) -> nn.Module:
    # four square layers of width h hold about 4*h*h parameters
    width = max(8, int((million * 1e6 / 4) ** 0.5))
    layers = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def run(rank: int, world: int, transport: str, args, location: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model(args.params)
    sync = None
    if transport == "gloo":
        dist.init_process_group("gloo", init_method=f"file://{location}/gloo.store",
                                rank=rank, world_size=world)
        ddp = DDP(model)
    elif transport == "ferrosync":
        dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world)
        ddp = DDP(model)
    else:
        sync = ferrosync.connect(location, rank=rank, world_size=world)
        ddp = ferrosync.ddp.wrap(model, sync)
    width = model[0].in_features
    x = torch.randn(args.batch_size, width)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    nparams = sum(p.numel() for p in model.parameters())
    with open(os.path.join(out_dir, f"{transport}.{rank}.json"), "w") as f:
        json.dump({"times": times, "params": nparams}, f)
    if sync is not None:
        sync.close()
    else:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (local processes)")
    parser.add_argument("--params", type=float, default=4.0,
                        help="model size in millions of float32 parameters")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--location", default=None,
                        help="directory or fsspec URL for ferrosync (default: a temp dir); "
                        "each transport uses its own subdirectory")
    parser.add_argument("--transports", default="gloo,ferrosync,hook",
                        help="comma-separated subset of gloo,ferrosync,hook")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        base = args.location or tmp
        for transport in args.transports.split(","):
            location = f"{base.rstrip('/')}/{transport}"
            if "://" not in location:
                os.makedirs(location, exist_ok=True)
            mp.spawn(run, args=(args.nproc, transport, args, location, tmp), nprocs=args.nproc)
            per_rank = []
            for r in range(args.nproc):
                with open(os.path.join(tmp, f"{transport}.{r}.json")) as f:
                    per_rank.append(json.load(f))
            # a step is as slow as its slowest rank
            steps = [max(ts) for ts in zip(*(p["times"] for p in per_rank))]
            ms = sorted(t * 1e3 for t in steps)
            p90 = ms[int(0.9 * (len(ms) - 1))]
            mb = per_rank[0]["params"] * 4 / 2**20
            print(f"{transport:10s} ranks={args.nproc} grads={mb:.1f} MiB/step "
                  f"median={statistics.median(ms):.1f} ms p90={p90:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
