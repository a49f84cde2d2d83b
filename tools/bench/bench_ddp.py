"""Time a DDP training step on gloo, the "ferrosync" backend and the ferrosync comm hook.

    python tools/bench/bench_ddp.py                          # 2 ranks, ~4M parameters, a temp dir
    python tools/bench/bench_ddp.py --params 16 --repeats 3  # the docs/ddp.md numbers
    python tools/bench/bench_ddp.py --nproc 3 --params 16 --steps 30 --location /mnt/nfs/bench

Each transport runs the same model (an MLP with about ``--params`` million float32
parameters) and batch on every rank; after ``--warmup`` steps it times ``--steps``
optimizer steps. Transports:

* ``gloo``: stock DDP on torch's gloo backend (the reference);
* ``ferrosync``: stock DDP on the "ferrosync" backend, allreduce asynchronous, so DDP
  overlaps each bucket's storage round trip with the rest of the backward pass;
* ``ferrosync-sync``: the same with ``pg_options={"overlap": False}`` (every
  collective synchronous, as before overlap existed);
* ``hook``: ``ferrosync.ddp.wrap`` (the comm hook, synchronous).

``--storage-latency S`` makes every ferrosync data object (each rank's contribution
and each result, not heartbeats) take S seconds longer to write and to read, through
ferrosync's fault injection (``FERROSYNC_FAULTS`` "delay"), to stand in for a remote
store's round trips on one host; gloo is not slowed.

Per run it prints one line per transport (median and p90 step time, gradient bytes per
step); with ``--repeats N`` the transports run N times, interleaved, and a summary
gives each transport's median step time over the runs (min-max range) and its ratio
to gloo's.
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
    if args.storage_latency > 0:  # read at connect, by the storage layer
        os.environ["FERROSYNC_FAULTS"] = json.dumps([
            {"rank": rank, "phase": phase, "object": "any", "action": "delay",
             "seconds": args.storage_latency, "times": 0}
            for phase in ("write", "read")])
    model = make_model(args.params)
    sync = None
    if transport == "gloo":
        dist.init_process_group("gloo", init_method=f"file://{location}/gloo.store",
                                rank=rank, world_size=world)
        ddp = DDP(model)
    elif transport in ("ferrosync", "ferrosync-sync"):
        dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                                pg_options={"overlap": transport == "ferrosync"})
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
    parser.add_argument("--transports", default="gloo,ferrosync,ferrosync-sync,hook",
                        help="comma-separated subset of gloo,ferrosync,ferrosync-sync,hook")
    parser.add_argument("--storage-latency", type=float, default=0.0,
                        help="seconds added to every ferrosync data object's write and "
                        "read (simulated remote store; see above)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every transport this many times (interleaved) and "
                        "summarise the range")
    args = parser.parse_args()

    transports = args.transports.split(",")
    medians: dict[str, list[float]] = {t: [] for t in transports}
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        base = args.location or tmp
        for run_index in range(args.repeats):
            for transport in transports:
                location = f"{base.rstrip('/')}/{transport}.{run_index}"
                if "://" not in location:
                    os.makedirs(location, exist_ok=True)
                mp.spawn(run, args=(args.nproc, transport, args, location, tmp),
                         nprocs=args.nproc)
                per_rank = []
                for r in range(args.nproc):
                    with open(os.path.join(tmp, f"{transport}.{r}.json")) as f:
                        per_rank.append(json.load(f))
                # a step is as slow as its slowest rank
                steps = [max(ts) for ts in zip(*(p["times"] for p in per_rank))]
                ms = sorted(t * 1e3 for t in steps)
                p90 = ms[int(0.9 * (len(ms) - 1))]
                mb = per_rank[0]["params"] * 4 / 2**20
                medians[transport].append(statistics.median(ms))
                print(f"run {run_index + 1}/{args.repeats} {transport:14s} ranks={args.nproc} "
                      f"grads={mb:.1f} MiB/step median={statistics.median(ms):.1f} ms "
                      f"p90={p90:.1f} ms", flush=True)
    if args.repeats > 1 or "gloo" in medians:
        gloo = statistics.median(medians["gloo"]) if "gloo" in medians else None
        print(f"summary over {args.repeats} run(s): median step time (min-max of the runs' "
              "medians), ratio to gloo", flush=True)
        for transport, values in medians.items():
            mid = statistics.median(values)
            ratio = f" x{mid / gloo:.2f} gloo" if gloo else ""
            print(f"  {transport:14s} {mid:7.1f} ms ({min(values):.1f}-{max(values):.1f})"
                  f"{ratio}", flush=True)

if __name__ == "__main__":
    main()
