"""Average tensors across 2 local processes through a temporary directory.

Run:
    python examples/demo_average.py            # 2 ranks
    python examples/demo_average.py --nproc 4  # 4 ranks

Each rank holds a tensor filled with its rank + 1 and a weight of rank + 1; after
``average_`` every rank holds the same weighted average, printed below.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile

import torch


def rank_main(rank: int, world_size: int, url: str, out) -> None:
    import ferrosync

    with ferrosync.connect(url, rank=rank, world_size=world_size, timeout=60) as sync:
        x = torch.full((4,), float(rank + 1))
        total = sync.average_(x, weight=rank + 1)
        out.put((rank, total, x.tolist(), sync.stats["last"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ferrosync-demo-") as url:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, args.nproc, url, out))
                 for r in range(args.nproc)]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join()
    expected = sum((r + 1) ** 2 for r in range(args.nproc)) / sum(range(1, args.nproc + 1))
    for rank, total, values, last in results:
        print(f"rank {rank}: total weight {total:g}, average {values} "
              f"({last['bytes_written']} B written, {last['requests']} requests)")
    agree = len({tuple(v) for _, _, v, _ in results}) == 1
    print(f"expected {expected:.6f}; ranks agree bit for bit: {agree}")
    if not agree or any(abs(v[0] - expected) > 1e-6 for _, _, v, _ in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
