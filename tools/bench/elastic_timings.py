"""Churn timings of an elastic job, as a spot user sees them (docs/elastic.md#churn).

    python tools/bench/elastic_timings.py [--url DIR_OR_S3_URL] [--heartbeat-timeout S]
                                          [--runs N] [--seaweed] [--members 2,3,4,6]
                                          [--victims first,checker+last,last]
                                          [--scenarios kill,close,loss]

Three scenarios, each with real member processes on this machine (``--seaweed``: over
a SeaweedFS server started on loopback, ferrosync/testing/seaweed.py):

* **kill** (members that die together): for each size of ``--members`` (2 to 4: every
  round reads every contribution; from 5 every average is a tree round) and each kind
  of victims of ``--victims``, the members average in a loop and two of them are
  SIGKILLed at the same moment: ``first`` (roster positions 0 and 1: the roster's
  checker and the next in line), ``checker+last`` (0 and the last), ``last`` (the
  last two); at 2 members one of them (0, 0 and 1), so that one survives. Printed:
  seconds from the kill to the end of the first average a survivor completes without
  them, and that as a multiple of ``heartbeat_timeout`` (the bound set is 1.5), with
  the range over ``--runs``.
* **close**: 3 members; one catches SIGTERM and calls ``close()`` from its handler.
  Printed: seconds from the SIGTERM to the end of the first round without it.
* **loss** (total loss): 2 members publish their state every round and are SIGKILLed;
  one new member is started. Printed: seconds from the start of the new member's
  ``connect`` to the end of its first round (its Python start-up is printed apart),
  and the round of the state it resumed from against the newest published one.

Times are wall-clock times of one host (``time.time()`` in every process), so they are
comparable here. The numbers, the command that produced them and this machine's load
average are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from ferrosync.testing.members import add_member_flags, connect_member, member_command, member_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def member(args) -> None:
    """One member (run as a child of this script): average in a loop, log each round."""
    import torch

    with open(args.log, "a") as log:
        log.write(json.dumps({"connecting": time.time()}) + "\n")
    sync = connect_member(args, timeout=120)

    def on_term(*_):
        sync.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    log = open(args.log, "a", buffering=1)
    log.write(json.dumps({"connected": time.time(), "round": sync.round}) + "\n")
    if args.resume:
        state = sync.read_state()
        log.write(json.dumps({"resumed": None if state is None else state.round}) + "\n")
        if sync.founding:
            sync.average_([torch.zeros(1)], weight=1.0 if sync.rank == 0 else 0.0)
    while True:
        sync.average_([torch.ones(256)])
        log.write(json.dumps({"round": sync.round, "world": sync.world_size,
                              "rank": sync.rank, "pid": os.getpid(), "at": time.time()})
                  + "\n")
        if args.publish and sync.rank == 0:
            sync.publish_state([torch.ones(256)], {"round": sync.round})
        time.sleep(0.02)  # a training step


def _rows(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


class Job:
    def __init__(self, url: str, options: dict, workdir: str) -> None:
        self.url, self.options, self.workdir = url, options, workdir
        self.job = uuid.uuid4().hex[:8]
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, k: int, min_ranks: int, *extra) -> subprocess.Popen:
        cmd = member_command(__file__, url=self.url, job=self.job, options=self.options,
                             min_ranks=min_ranks, log=self.log(k), extra=extra)
        self.procs[k] = subprocess.Popen(cmd, env=member_env(ROOT), stderr=subprocess.DEVNULL)
        return self.procs[k]

    def log(self, k: int) -> str:
        return os.path.join(self.workdir, f"{self.job}.{k}.log")

    def rows(self, k: int) -> list[dict]:
        return [r for r in _rows(self.log(k)) if "world" in r]

    def wait(self, predicate, what: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.02)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


def _first_round_without(job: Job, survivors, world: int, after: float) -> float:
    job.wait(lambda: all(any(r["world"] == world and r["at"] > after for r in job.rows(k))
                         for k in survivors), f"a round of {world} members")
    return min(r["at"] for k in survivors for r in job.rows(k)
               if r["world"] == world and r["at"] > after) - after


#: the victim sets of the kill scenario, as roster positions of ``members`` members
#: (two of them; at 2 members one, so that a member survives to average without it)
VICTIMS = {
    "first": lambda n: (0, 1) if n > 2 else (0,),  # the checker and the next in line
    "checker+last": lambda n: (0, n - 1) if n > 2 else (0,),
    "last": lambda n: (n - 2, n - 1) if n > 2 else (1,),
}


def kill_together(url, options, workdir, members: int, positions) -> float:
    """Seconds from SIGKILLing the members at roster ``positions`` together to the end
    of the first average a survivor completes without them."""
    job = Job(url, options, workdir)
    try:
        for k in range(members):  # min_ranks the survivors meet: they go on without the victims
            job.start(k, min(2, members - len(positions)))
        job.wait(lambda: all(len(job.rows(k)) >= 5 and job.rows(k)[-1]["world"] == members
                             for k in range(members)), f"{members} members")
        ranks = {job.rows(k)[-1]["rank"]: k for k in range(members)}
        victims = [ranks[p] for p in positions]
        killed = time.time()
        for k in victims:
            job.procs[k].send_signal(signal.SIGKILL)
        survivors = [k for k in range(members) if k not in victims]
        return _first_round_without(job, survivors, members - len(victims), killed)
    finally:
        job.stop()


def close_leave(url, options, workdir) -> float:
    job = Job(url, options, workdir)
    try:
        for k in range(3):
            job.start(k, 2)
        job.wait(lambda: all(len(job.rows(k)) >= 5 and job.rows(k)[-1]["world"] == 3
                             for k in range(3)), "three members")
        sent = time.time()
        job.procs[1].send_signal(signal.SIGTERM)
        return _first_round_without(job, [0, 2], 2, sent)
    finally:
        job.stop()


def total_loss(url, options, workdir) -> tuple[float, float, int, int]:
    job = Job(url, options, workdir)
    try:
        for k in range(2):
            job.start(k, 2, "--publish")
        job.wait(lambda: all(len(job.rows(k)) >= 10 for k in range(2)), "two members")
        for k in range(2):
            job.procs[k].send_signal(signal.SIGKILL)
            job.procs[k].wait()
        newest = max(r["round"] for k in range(2) for r in job.rows(k) if r["rank"] == 0)
        started = time.time()
        job.start(9, 1, "--resume")
        job.wait(lambda: job.rows(9), "the new member's first round", timeout=300)
        rows = _rows(job.log(9))
        connecting = next(r["connecting"] for r in rows if "connecting" in r)
        resumed = next(r["resumed"] for r in rows if "resumed" in r)
        return job.rows(9)[0]["at"] - connecting, connecting - started, resumed, newest
    finally:
        job.stop()


def kill_table(url, options, workdir, args, t: float) -> None:
    """The kill scenario for every size and kind of victims, ``args.runs`` times each:
    one line per run, then a markdown table of the ranges (docs/elastic.md#churn)."""
    rows = []
    for members in [int(m) for m in args.members.split(",")]:
        for kind in args.victims.split(","):
            positions = VICTIMS[kind](members)
            took = []
            for run in range(args.runs):
                took.append(kill_together(url, options, workdir, members, positions))
                print(f"run {run}: {members} members, positions {positions} killed "
                      f"together ({kind}): dropped after {took[-1]:.2f} s "
                      f"({took[-1] / t:.2f} x heartbeat_timeout {t:g} s)", flush=True)
            rows.append((members, kind, positions, took))
    print(f"\n| members | killed together (roster positions) | dropped after "
          f"(range over {args.runs}) | x heartbeat_timeout ({t:g} s) |\n|---|---|---|---|")
    for members, kind, positions, took in rows:
        print(f"| {members} | {kind} {positions} | {min(took):.2f}-{max(took):.2f} s | "
              f"{min(took) / t:.2f}-{max(took) / t:.2f} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_member_flags(p)
    p.add_argument("--publish", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help="where the jobs live (default: a temporary directory)")
    p.add_argument("--seaweed", action="store_true", help="over a local SeaweedFS server")
    p.add_argument("--heartbeat-timeout", type=float, default=6.0)
    p.add_argument("--heartbeat-interval", type=float, default=None)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--members", default="2,3,4,6", help="sizes of the kill scenario's job, "
                   "comma-separated (from 5 every average is a tree round)")
    p.add_argument("--victims", default=",".join(VICTIMS),
                   help="kinds of victims of the kill scenario: " + ", ".join(VICTIMS))
    p.add_argument("--scenarios", default="kill,close,loss")
    args = p.parse_args()
    if args.member:
        member(args)
        return 0
    workdir = tempfile.mkdtemp(prefix="ferrosync-timings-")
    options = {"heartbeat_timeout": args.heartbeat_timeout}
    if args.heartbeat_interval:
        options["heartbeat_interval"] = args.heartbeat_interval
    server = None
    url = args.url or os.path.join(workdir, "store")
    if args.seaweed:
        from ferrosync.testing.seaweed import SeaweedServer, s3_storage_options, weed_binary

        server = SeaweedServer(weed_binary(), os.path.join(workdir, "weed"))
        server.start()
        options["storage_options"] = s3_storage_options(server.endpoint)
        url = f"s3://{server.bucket}/timings"
    try:
        print("command: python tools/bench/elastic_timings.py "
              + shlex.join(sys.argv[1:]), flush=True)
        print("load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
        scenarios = args.scenarios.split(",")
        t = args.heartbeat_timeout
        if "kill" in scenarios:
            kill_table(url, options, workdir, args, t)
        for run in range(args.runs):
            if "close" in scenarios:
                leave = close_leave(url, options, workdir)
                print(f"run {run}: close() from a SIGTERM handler: dropped after "
                      f"{leave:.2f} s", flush=True)
            if "loss" in scenarios:
                took, startup, resumed, newest = total_loss(url, options, workdir)
                print(f"run {run}: total loss: the new member trained {took:.2f} s after "
                      f"its connect (+ {startup:.2f} s Python start-up), from the state of "
                      f"round {resumed} (newest published: {newest})", flush=True)
        print("load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
