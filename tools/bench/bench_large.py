"""Large payloads through an object store whose connections are each capped: time
against the link's ideal, peak RSS against the payload, requests.

    python tools/bench/bench_large.py                                   # 64 MiB, 1/4/16 in flight
    python tools/bench/bench_large.py --mib 256 --link 96MB/s --connection-rate 6MB/s \\
        --concurrency 1,4,16 --runs 3 --job

A SeaweedFS S3 server runs on loopback behind ``ferrosync/testing/wan_proxy.py``: one
link shared by every connection (``--link``, each direction) and a cap on each
connection (``--connection-rate``), as a real store serves each connection at about
100 MB/s however fast the host is. For each ``--concurrency`` (``transfer_concurrency``)
and run:

* **put / get**: one process writes one object of ``--mib`` MiB (``Storage.put``) and
  reads it back into a preallocated buffer (``Storage.open`` + ``readinto``): seconds,
  ratio to the ideal (bytes / link rate), requests, and the peak RSS above the
  process's RSS with the payload allocated (``VmHWM`` after ``clear_refs``);
* **job** (``--job``): a fixed-size job of 2 ranks averages the payload (gather: each
  rank writes its contribution and reads the other's), through ``tools/bench/bench.py``'s
  rank harness: the slowest rank's median seconds, its ratio to the link's ideal
  (2 x payload each way / link rate), rank 0's peak RSS above its baseline (the payload
  tensor itself included) over the payload, and requests. ``--reduce gather,sharded``
  runs it in each mode (sharded: a rank reduces 1/W of the payload, so its accumulator
  is 1/W of it, where gather's is the whole payload).

Prints one line per measurement, then the command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from bench import SEAWEED_BUCKET, run_group  # this script's directory: tools/bench/
from bench import start_seaweed as start_server

from ferrosync.storage.engines import open_storage
from ferrosync.testing.measure import MIB, peak_rss_mb, reset_peak_rss, rss_mb
from ferrosync.testing.seaweed import s3_storage_options
from ferrosync.testing.wan_proxy import WanProxy, parse_rate


def put_get(url: str, options: dict, nbytes: int, transfer: dict, link_bps: float) -> list[str]:
    """One put and one get of ``nbytes`` through ``url``: a line for each."""
    storage = open_storage(url, options, transfer=transfer)
    payload = bytearray(os.urandom(MIB)) * (nbytes // MIB)
    into = bytearray(nbytes)
    ideal = nbytes * 8 / link_bps
    lines = []
    try:
        for what in ("put", "get"):
            before = storage.counters.snapshot()["requests"]
            reset_peak_rss()
            base = rss_mb()
            t0 = time.perf_counter()
            if what == "put":
                storage.put("bench-large", [payload])
            else:
                with storage.open("bench-large", max_bytes=nbytes) as reader:
                    assert reader.readinto(into) == nbytes
            dt = time.perf_counter() - t0
            extra = peak_rss_mb() - base
            requests = storage.counters.snapshot()["requests"] - before
            lines.append(f"{what:4} {nbytes / MIB:6.0f} MiB concurrency "
                         f"{transfer['concurrency']:3}: {dt:7.2f} s, {ideal / dt:5.0%} of the "
                         f"link, {requests:4} requests, peak RSS +{extra:6.1f} MiB "
                         f"({extra * MIB / nbytes:.2f} x payload)")
        assert into == payload, "read back other bytes"
        storage.delete(["bench-large"])
    finally:
        storage.close()
    return lines


def job(url: str, options: dict, nbytes: int, transfer: dict, link_bps: float,
        runs: int, reduce: str = "gather") -> str:
    spec = {"kind": "s3", "threads": "pinned", "url": url,
            "options": {"storage_options": options, "reduce": reduce,
                        **{("transfer_concurrency" if k == "concurrency" else k): v
                           for k, v in transfer.items() if v is not None}}}
    (row,) = run_group(spec, 2, [nbytes], 1, runs)
    ideal = 2 * nbytes * 8 / link_bps  # each rank's contribution up, the other's down
    seconds = row["p50_ms"] / 1e3
    rss = row["rank0_rss_above_baseline_mb"]
    return (f"job  {nbytes / MIB:6.0f} MiB concurrency {transfer['concurrency']:3} "
            f"{reduce}: "
            f"{seconds:7.2f} s (median of {runs}), {ideal / seconds:5.0%} of the link, "
            f"{row['requests_rank0'] or 0:6.0f} requests (rank 0), peak RSS "
            f"+{rss:6.1f} MiB ({rss * MIB / nbytes:.2f} x payload, the tensor included)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="payload in MiB (default 64)")
    parser.add_argument("--link", type=parse_rate, default=parse_rate("96MB/s"),
                        help="the shared link, each direction (default 96MB/s)")
    parser.add_argument("--connection-rate", type=parse_rate, default=parse_rate("6MB/s"),
                        help="each connection's cap (default 6MB/s: 1/16 of the link)")
    parser.add_argument("--concurrency", default="1,4,16",
                        help="transfer_concurrency values, comma-separated")
    parser.add_argument("--part-mib", type=int, default=None, help="part_bytes in MiB")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--job", action="store_true", help="also a 2-rank average")
    parser.add_argument("--reduce", default="gather",
                        help="the job's reduce modes, comma-separated (default gather)")
    parser.add_argument("--no-put-get", action="store_true",
                        help="only the job (with --job)")
    args = parser.parse_args()
    tmp: list[str] = []
    server, _ = start_server(tmp)
    port = int(server.endpoint.rsplit(":", 1)[1])
    try:
        with WanProxy(port, rate_bps=args.link,
                      connection_rate_bps=args.connection_rate) as proxy:
            options = s3_storage_options(proxy.endpoint)
            for run in range(args.runs):
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    transfer = {"concurrency": concurrency,
                                "part_bytes": args.part_mib and args.part_mib * MIB}
                    url = f"s3://{SEAWEED_BUCKET}/bench-large-{run}-{concurrency}"
                    if not args.no_put_get:
                        for line in put_get(url, options, args.mib * MIB, transfer,
                                            args.link):
                            print(line, flush=True)
                    for reduce in args.reduce.split(",") if args.job else ():
                        print(job(url, options, args.mib * MIB, transfer, args.link, 2,
                                  reduce), flush=True)
    finally:
        server.stop()
        for path in tmp:
            shutil.rmtree(path, ignore_errors=True)
    print("command: python tools/bench/bench_large.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
