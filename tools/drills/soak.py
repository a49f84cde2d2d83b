"""Soak: many collectives on a local directory; open files, objects and RSS stay bounded.

Run:
    python tools/drills/soak.py                          # 10,000 collectives, 4 ranks, 64 KiB
    python tools/drills/soak.py --collectives 2000 --ranks 2 --payload 1MiB

Every rank runs ``--collectives`` collectives (mostly ``average_``, with a broadcast,
an all_gather and a barrier mixed in) and samples, every ``--every`` collectives, its
open file descriptors and RSS; rank 0 also counts the objects under the run's
directory. The table shows the samples; the run fails (exit 1) if the last
samples exceed the first steady ones by more than the stated slack. The suite runs a
short version on every storage transport (tests/test_contract.py,
``test_storage_stays_bounded_over_many_collectives``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time


def rank_main(rank, world, url, collectives, every, payload, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    import ferrosync
    from ferrosync.testing.measure import rss_mb

    samples = []
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=120) as sync:
        x = torch.randn(payload // 4)
        t0 = time.perf_counter()
        for i in range(1, collectives + 1):
            if i % 97 == 0:
                sync.broadcast_(x, src=i % world)
            elif i % 101 == 0:
                sync.all_gather(x[:16])
            elif i % 89 == 0:
                sync.barrier()
            else:
                sync.average_(x)
            if i % every == 0:
                objects = None
                if rank == 0:
                    objects = sum(len(files) for _, _, files in os.walk(url))
                samples.append({"collective": i, "fds": len(os.listdir("/proc/self/fd")),
                                "rss_mb": rss_mb(), "objects": objects,
                                "elapsed_s": time.perf_counter() - t0})
    out.put((rank, samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=10_000, help="collectives per rank")
    parser.add_argument("--ranks", type=int, default=4, help="number of local ranks")
    parser.add_argument("--payload", default="64KiB", help="float32 payload (KiB/MiB)")
    parser.add_argument("--every", type=int, default=1000, help="sample every N collectives")
    parser.add_argument("--dir", default=None, help="parent directory (default: a temp dir)")
    args = parser.parse_args()
    # not at the top: a spawned rank sets OMP_NUM_THREADS before anything imports torch
    # (importing ferrosync does)
    from ferrosync.testing.measure import parse_size

    payload = parse_size(args.payload)
    with tempfile.TemporaryDirectory(prefix="ferrosync-soak-", dir=args.dir) as url:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, url, args.collectives,
                                                     args.every, payload, out))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=7200) for _ in procs)
        for p in procs:
            p.join()
    print(f"$ python tools/drills/soak.py {' '.join(sys.argv[1:])}")
    print(f"{'collective':>10} {'s':>7} {'objects':>8} " +
          " ".join(f"{'fds r' + str(r):>7} {'RSS r' + str(r):>8}" for r in range(args.ranks)))
    for i, s0 in enumerate(results[0]):
        row = f"{s0['collective']:>10} {s0['elapsed_s']:>7.1f} {s0['objects']:>8} "
        row += " ".join(f"{results[r][i]['fds']:>7} {results[r][i]['rss_mb']:>8.1f}"
                        for r in range(args.ranks))
        print(row)
    ok = True
    for r in range(args.ranks):
        s = results[r]
        base = s[min(1, len(s) - 1)]  # after warm-up
        last = s[-1]
        if last["fds"] > base["fds"] + 2 or last["rss_mb"] > base["rss_mb"] * 1.10 + 20:
            print(f"rank {r}: grew from {base} to {last}")
            ok = False
    objects = [s["objects"] for s in results[0]]
    print(f"objects on storage: min {min(objects)}, max {max(objects)}")
    print("bounded: yes" if ok else "bounded: NO")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
