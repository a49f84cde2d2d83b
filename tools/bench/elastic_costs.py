"""What an elastic round costs per member: requests by kind and bytes, measured and
modelled (docs/elastic.md#cost).

    python tools/bench/elastic_costs.py [--members 2,4] [--payload MiB] [--rounds R]
                                        [--seaweed] [--large] [--url DIR]
    python tools/bench/elastic_costs.py --model [--round-rate R/s] [--payload MiB]

Measured: W member processes of one elastic job (``connect(url, elastic=True,
min_ranks=W)``) run R rounds of ``average_`` on a payload of P bytes (float32). Each
member snapshots its storage counters (``sync.counters``: puts, gets, lists, deletes,
bytes read and written; every request of the process, heartbeats included: the same
counters as ``sync.stats``) around each round. Printed per W: the mean per member per
round of each kind (the checker, member 0, apart), bytes read/written, the busiest
member's bytes read as a multiple of P, and the mean round time. ``--seaweed`` runs over
a SeaweedFS server started on loopback (ferrosync/testing/seaweed.py) with its Prometheus metrics on
(``-metricsPort``, loopback): the server's own request count over the whole run is
printed beside the clients' sum. ``--large`` adds W = 8 and 16 (kept out of CI).
Over a directory (the default) the requests are file-system calls with no kind: only
the total and the bytes mean anything there; use ``--seaweed`` (or an s3:// ``--url``).

Modelled (``--model``): a healthy round (all-read-all below 5 members, the tree reduce
from 5: ``ferrosync/elastic/tree.py``'s own plan), per member, for the checker and for
the busiest member (requests by kind, bytes), the latency model (RTT x sequential
requests + bytes read / bandwidth), the request cost per hour at W = 10, 100, 1,000
at S3 list prices (``ferrosync/storage/providers.py``) for ``--round-rate`` rounds per second, and
the heartbeat cost per hour at the default ``heartbeat_interval``. With a measurement the model is
compared with it. The command that produced the output is printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

from ferrosync.elastic.costs import KINDS, job_cost_per_hour, latency, model, polls
from ferrosync.testing.measure import MIB
from ferrosync.testing.members import add_member_flags, connect_member, member_command, member_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def print_model(payload: int, round_rate: float, rtt: float, bandwidth: float) -> None:
    from ferrosync.storage.providers import provider_of

    store = provider_of("s3://")
    prices = dict(store.prices)
    from ferrosync.elastic.options import ElasticOptions

    hb = ElasticOptions.interval_object_store  # an elastic member's default on S3
    print("model: a healthy round (all-read-all below 5 members, the tree from 5), "
          f"P = {payload / MIB:g} MiB, S3 list prices "
          f"{prices} USD per 1,000, heartbeat_interval {hb:g} s (elastic default on an "
          "object store; heartbeats $/h: its PUTs plus at most one GET per member per "
          "interval), "
          f"{round_rate:g} rounds/s, RTT {rtt * 1e3:g} ms, {bandwidth / 1e6:g} MB/s")
    print(f"{'W':>6} {'GET/member':>11} {'PUT':>4} {'DEL':>4} {'read/member':>12} "
          f"{'xP':>6} {'busiest xP':>10} {'req/round (job)':>16} {'round s':>9} {'rounds $/h':>11} "
          f"{'heartbeats $/h':>15}")
    for w in (2, 4, 8, 16, 10, 100, 1000):
        mod = model(w, payload, round_s=0.0, hb_interval=hb)
        m = mod["member"]
        c = job_cost_per_hour(w, payload, round_rate, hb, prices)
        print(f"{w:>6} {m['gets']:>11.1f} {m['puts']:>4.1f} {m['deletes']:>4.1f} "
              f"{m['bytes_read'] / MIB:>8.2f} MiB {m['bytes_read'] / payload:>6.2f} "
              f"{mod['busiest']['bytes_read'] / payload:>10.2f} "
              f"{c['requests_per_round']:>16,.0f} "
              f"{latency(w, payload, rtt=rtt, bandwidth=bandwidth):>9.2f} "
              f"{c['rounds_usd']:>11,.2f} {c['heartbeats_usd']:>15,.2f}")
    print("Below 5 members every member reads every contribution (GET/member: W-1 "
          "contributions + 1 roster read; the checker adds 2 GETs and reads all W). From "
          "5 on the tree reduce: per member its slices, marker and computed objects "
          "(PUT; deleted two rounds later in one batch DELETE), the tree objects it reads "
          "(GET) and about 2 x P read; the checker reads W header-only markers. Polls "
          "while waiting add a GET each; every member's heartbeat adds a PUT per "
          "heartbeat_interval.")


# -- one member (a child process) --------------------------------------------------------

def member(args) -> None:
    import torch

    sync = connect_member(args, timeout=300)
    flat = torch.ones(args.payload // 4)
    sync.average_([flat])  # a warm-up round (the first roster's cleanup starts later)
    rows = []
    for _ in range(args.rounds):
        before = sync.counters.snapshot()
        t0 = time.perf_counter()
        sync.average_([flat])
        took = time.perf_counter() - t0
        after = sync.counters.snapshot()
        row = {k: after[k] - before[k] for k in (*KINDS, "requests", "bytes_read",
                                                   "bytes_written")}
        row.update(rank=sync.rank, world=sync.world_size, round=sync.round, s=took,
                   stats_requests=sync.stats["last"]["requests"],
                   stats_bytes_read=sync.stats["last"]["bytes_read"])
        rows.append(row)
    sync.barrier()  # nobody leaves while another still reads its contributions
    total = sync.counters.snapshot()
    sync.close()
    total_after = sync.counters.snapshot()
    with open(args.log, "w") as f:
        json.dump({"rows": rows, "total": total_after, "before_close": total}, f)


# -- the measurement ---------------------------------------------------------------------

def _server_requests(metrics_url: str | None) -> dict | None:
    """SeaweedFS's own S3 request counts by type (its Prometheus endpoint)."""
    if metrics_url is None:
        return None
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("SeaweedFS_s3_request_total{"):
            labels, value = line.rsplit(" ", 1)
            kind = labels.split('type="', 1)[1].split('"', 1)[0]
            counts[kind] = counts.get(kind, 0) + float(value)
    return counts


def measure(w: int, args, url: str, options: dict, workdir: str,
            metrics_url: str | None) -> dict:
    job = uuid.uuid4().hex[:8]
    logs = [os.path.join(workdir, f"{job}.{k}.json") for k in range(w)]
    server_before = _server_requests(metrics_url)
    t0 = time.monotonic()
    extra = ("--payload-bytes", str(args.payload_bytes), "--rounds", str(args.rounds))
    procs = [subprocess.Popen(member_command(__file__, url=url, job=job, options=options,
                                             min_ranks=w, log=log, extra=extra),
                              env=member_env(ROOT)) for log in logs]
    codes = [p.wait(timeout=1800) for p in procs]
    wall = time.monotonic() - t0
    if any(codes):
        raise SystemExit(f"W={w}: members exited {codes}")
    time.sleep(0.5)  # the server's counters are updated after the response
    server_after = _server_requests(metrics_url)
    results = []
    for log in logs:
        with open(log) as f:
            results.append(json.load(f))
    rows = [r for res in results for r in res["rows"]]
    assert all(r["world"] == w for r in rows), "the membership changed during the run"

    def mean(select, key):
        picked = [r[key] for r in rows if select(r)]
        return sum(picked) / len(picked)

    out = {"W": w, "wall_s": wall, "rows": len(rows)}
    for who, select in (("member", lambda r: r["rank"] != 0), ("checker",
                                                               lambda r: r["rank"] == 0)):
        out[who] = {k: mean(select, k) for k in (*KINDS, "requests", "bytes_read",
                                                  "bytes_written", "s")}
    per_member = {}
    for r in rows:
        per_member.setdefault(r["rank"], []).append(r["bytes_read"])
    out["busiest_read_xP"] = max(sum(v) / len(v) for v in per_member.values()) \
        / args.payload_bytes
    out["clients_total"] = sum(res["total"]["requests"] for res in results)
    out["clients_total_by_kind"] = {k: sum(res["total"][k] for res in results)
                                    for k in KINDS}
    if server_before is not None:
        out["server_total"] = sum(server_after.values()) - sum(server_before.values())
        out["server_by_type"] = {k: v - server_before.get(k, 0)
                                 for k, v in server_after.items()
                                 if v - server_before.get(k, 0)}
    return out


def print_measured(res: dict, payload: int, hb: float) -> None:
    w = res["W"]
    for who in ("member", "checker"):
        m = res[who]
        mod = model(w, payload, round_s=m["s"], hb_interval=hb)[who]
        print(f"  W={w:<3} {who:<8} puts {m['puts']:5.2f} gets {m['gets']:6.2f} "
              f"lists {m['lists']:4.2f} deletes {m['deletes']:4.2f} = {m['requests']:6.2f} "
              f"req (model floor {mod['requests']:6.2f}: gets {mod['gets']:5.2f}, puts "
              f"{mod['puts']:4.2f}); read {m['bytes_read'] / payload:5.2f} P "
              f"(model {mod['bytes_read'] / payload:4.2f} P), written "
              f"{m['bytes_written'] / payload:4.2f} P; round {m['s']:.3f} s; above the floor "
              f"{m['requests'] - mod['requests']:+.2f} (allowance: 2 x "
              f"{polls(m['s'])} polls + 2 = {2 * polls(m['s']) + 2})")
    line = (f"  W={w:<3} busiest member reads {res['busiest_read_xP']:.2f} P per round; "
            f"whole run: clients counted {res['clients_total']} requests "
            f"{res['clients_total_by_kind']}")
    if "server_total" in res:
        line += (f"; the server counted {res['server_total']:.0f} "
                 f"({ {k: int(v) for k, v in res['server_by_type'].items()} })")
    print(line, flush=True)


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_member_flags(p)
    p.add_argument("--payload-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--members", default="2,4", help="member counts, comma-separated")
    p.add_argument("--large", action="store_true", help="add W = 8 and 16 (not in CI)")
    p.add_argument("--payload", type=float, default=1.0, help="MiB per round (float32)")
    p.add_argument("--rounds", type=int, default=10, help="measured rounds per W")
    p.add_argument("--url", help="where the jobs live (default: a temporary directory)")
    p.add_argument("--storage-options", default=None, help="JSON for connect's "
                   "storage_options (with --url)")
    p.add_argument("--seaweed", action="store_true", help="over a local SeaweedFS server")
    p.add_argument("--model", action="store_true", help="print the model only")
    p.add_argument("--round-rate", type=float, default=1.0, help="rounds per second "
                   "for the hourly cost (default 1)")
    p.add_argument("--rtt", type=float, default=0.02, help="seconds per request (S3: "
                   "~20 ms for a small GET)")
    p.add_argument("--bandwidth", type=float, default=100e6, help="bytes/s one member "
                   "reads at")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args()


def _metered_seaweed(workdir: str):
    """A SeaweedFS server started under ``workdir`` with its Prometheus metrics on
    loopback too: (the server, its metrics URL, storage_options to reach it)."""
    from ferrosync.core.ports import free_port
    from ferrosync.testing.seaweed import SeaweedServer, s3_storage_options, weed_binary

    metrics_port = free_port()

    class Metered(SeaweedServer):
        def command(self):  # its Prometheus endpoint, on loopback too
            return super().command() + [f"-metricsPort={metrics_port}",
                                        "-metricsIp=127.0.0.1"]

    server = Metered(weed_binary(), os.path.join(workdir, "weed"))
    server.start()
    return (server, f"http://127.0.0.1:{metrics_port}/metrics",
            s3_storage_options(server.endpoint))


def main() -> int:
    args = _parse_args()
    if args.member:
        args.payload = args.payload_bytes
        member(args)
        return 0
    args.payload_bytes = int(args.payload * MIB) // 4 * 4
    print("command: python tools/bench/elastic_costs.py " + shlex.join(sys.argv[1:]), flush=True)
    print_model(args.payload_bytes, args.round_rate, args.rtt, args.bandwidth)
    if args.model:
        return 0
    sizes = [int(x) for x in args.members.split(",")] + ([8, 16] if args.large else [])
    workdir = tempfile.mkdtemp(prefix="ferrosync-costs-")
    options: dict = {}
    if args.storage_options:
        options["storage_options"] = json.loads(args.storage_options)
    server = metrics_url = None
    url = args.url or os.path.join(workdir, "store")
    from ferrosync.elastic.options import ElasticOptions

    # the elastic defaults (ElasticOptions.timing): a directory, an object store
    hb = 1.0 if "://" not in url else ElasticOptions.interval_object_store
    if args.seaweed:
        server, metrics_url, options["storage_options"] = _metered_seaweed(workdir)
        url = f"s3://{server.bucket}/costs"
        hb = ElasticOptions.interval_object_store
    results = []
    try:
        print(f"measured: {args.rounds} rounds of {args.payload_bytes / MIB:g} MiB per W, "
              f"{'SeaweedFS' if args.seaweed else 'a directory'}, per member per round "
              f"(means; every request of the process, heartbeats included); "
              f"{os.cpu_count()} CPUs, a loaded machine", flush=True)
        for w in sizes:
            res = measure(w, args, url, options, workdir, metrics_url)
            results.append(res)
            print_measured(res, args.payload_bytes, hb)
    finally:
        if server is not None:
            server.stop()
        # the members' logs and the store (or the server's data): nothing a reader needs
        # once the table above is printed
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
