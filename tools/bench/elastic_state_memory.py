"""What reading an elastic job's published state costs in memory.

    python tools/bench/elastic_state_memory.py                 # 512 MiB, a temporary directory
    python tools/bench/elastic_state_memory.py --mib 1024 --url /dev/shm/state-mem --runs 3
    python tools/bench/elastic_state_memory.py --url s3://bucket/state-mem \
        --storage-options '{"endpoint_url": "http://127.0.0.1:8333", "key": "k", "secret": "s"}'

One process publishes a float32 state of ``--mib`` MiB (``publish_state``) in an
elastic job at ``--url``; then, for each of ``read_state`` and ``fetch_state``, a fresh
process connects, and its peak RSS (``ru_maxrss``) is taken before and after the read:
the difference over the state's size is what the read cost, the tensors it returns
(``read_state``) or the copy it verifies into (``fetch_state``) included. ``fetch_state``'s
own destination tensors are allocated before the "before" figure. Prints one line per
read and run, then the command.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile

MIB = 1 << 20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def publish(url: str, mib: int, options: dict) -> None:
    import torch

    import ferrosync

    with ferrosync.connect(url, elastic=True, job="state-memory", timeout=60,
                           **options) as sync:
        sync.publish_state({"w": torch.ones(mib * MIB // 4)}, {"step": 1})


def read(url: str, mib: int, how: str, options: dict) -> None:
    import torch

    import ferrosync

    with ferrosync.connect(url, elastic=True, job="state-memory", timeout=60,
                           **options) as sync:
        mine = torch.zeros(mib * MIB // 4) if how == "fetch_state" else None
        before = peak_mib()
        if how == "fetch_state":
            sync.fetch_state({"w": mine})
        else:
            got = sync.read_state()
            assert got.tensors["w"].numel() == mib * MIB // 4
        after = peak_mib()
    print(f"{how:11s} {mib} MiB state: peak RSS +{after - before:.0f} MiB "
          f"({(after - before) / mib:.2f} x its size)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="state size in MiB")
    parser.add_argument("--url", help="where the job lives (default: a temporary directory)")
    parser.add_argument("--runs", type=int, default=1, help="reads of each kind")
    parser.add_argument("--storage-options", default="{}",
                        help="JSON for connect's storage_options (an object store's)")
    parser.add_argument("--role", choices=["publish", "read_state", "fetch_state"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    storage = json.loads(args.storage_options)
    options = {"storage_options": storage} if storage else {}
    if args.role == "publish":
        publish(args.url, args.mib, options)
        return 0
    if args.role:
        read(args.url, args.mib, args.role, options)
        return 0
    url = args.url or tempfile.mkdtemp(prefix="state-memory-")
    me = [sys.executable, __file__, "--url", url, "--mib", str(args.mib),
          "--storage-options", args.storage_options]
    subprocess.run([*me, "--role", "publish"], check=True)
    for _ in range(args.runs):
        for how in ("read_state", "fetch_state"):
            subprocess.run([*me, "--role", how], check=True)
    print("command: python tools/bench/elastic_state_memory.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
