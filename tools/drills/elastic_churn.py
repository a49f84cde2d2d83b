"""The spot-instance scenario, end to end: members of one elastic job started as
separate processes, one SIGKILLed mid-run, a new one started once the others dropped
it; prints what every member reported and whether they ended as one model.

    python tools/drills/elastic_churn.py                       # diloco on the demo, 3 members
    python tools/drills/elastic_churn.py --strategy grad --steps 400 --kill-at 100
    python tools/drills/elastic_churn.py --sync s3://bucket/prefix --sync-option storage_options=...

Each member is ``python -m ferrosync.train --elastic`` with its own ``--metrics`` file;
the tool watches those files (no sleeps stand in for progress) and prints a table:
exit code, the step it joined at, its FINAL digest and accuracy, and the longest sync
it waited (the member killed mid-sync holds the others for about
``heartbeat_timeout``). Exit code 0 when every member still running at the end exits
0 with the same digest. The suite runs the scenario short
(tests/test_elastic_train.py, ``test_diloco_job_survives_a_kill_and_takes_a_newcomer``).
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


def _last_step(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except ValueError:
            continue  # the line being written
    return -1


def _dropped(path: str, after: int, members: int) -> bool:
    """Whether a step after ``after`` ran with ``members`` members (the drop was seen)."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return False
    return any(r["step"] > after and r["members"] == members for r in rows)


def _wait(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"elastic_churn: {what} did not happen within {timeout:g} s")
        time.sleep(0.05)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=3, help="members started at once")
    p.add_argument("--min-ranks", type=int, default=2)
    p.add_argument("--strategy", default="diloco", choices=["grad", "local-sgd", "diloco"])
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--kill-at", type=int, default=120, help="SIGKILL a member past this step")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--sync", help="the job's URL (default: a fresh temporary directory)")
    p.add_argument("--sync-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--batch-size", type=int, default=1024,
                   help="per member; the default makes a demo step long enough that the job "
                   "outlasts the start of the new member")
    p.add_argument("--train-arg", action="append", default=[], metavar="FLAG",
                   help="passed to every member (e.g. --train-arg=--model=pkg:build)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run")
    return p.parse_args(argv)


def _member_command(args: argparse.Namespace, url: str) -> list[str]:
    """Every member's command line, but for its ``--metrics`` file."""
    common = [sys.executable, "-m", "ferrosync.train", "--elastic", "--sync", url,
              "--no-progress", "--min-ranks", str(args.min_ranks), "--strategy", args.strategy,
              "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              *args.train_arg, "--sync-option", "heartbeat_interval=0.3",
              "--sync-option", f"heartbeat_timeout={args.heartbeat_timeout:g}"]
    for option in args.sync_option:
        common += ["--sync-option", option]
    return common


def _collect(procs: dict, metrics: dict, deadline: float) -> list[tuple]:
    """Wait for every member (until ``deadline``, time.monotonic()); per member: (name,
    exit code, FINAL record or None, longest sync in s, last stderr line if it failed)."""
    rows = []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        final = next((json.loads(line[6:]) for line in reversed(out.splitlines())
                      if line.startswith("FINAL ")), None)
        syncs = []
        try:
            with open(metrics[name], encoding="utf-8") as f:
                syncs = [json.loads(line)["sync_s"] for line in f if line.endswith("\n")]
        except FileNotFoundError:
            pass
        rows.append((name, proc.returncode, final, max(syncs, default=0.0),
                     err.strip().splitlines()[-1] if proc.returncode not in (0, -9) else ""))
    return rows


def _print_table(rows: list[tuple]) -> None:
    print(f"{'member':<8}{'exit':>6}{'joined at':>11}{'steps':>7}{'members':>9}"
          f"{'changes':>9}{'accuracy':>10}{'longest sync':>14}  digest")
    for name, code, final, longest, error in rows:
        if final is None:
            print(f"{name:<8}{code:>6}{'-':>11}{'-':>7}{'-':>9}{'-':>9}{'-':>10}"
                  f"{longest:>13.2f}s  {error}")
            continue
        print(f"{name:<8}{code:>6}{final['joined_at_step']:>11}{final['steps']:>7}"
              f"{final['members']:>9}{final['membership_changes']:>9}"
              f"{100 * (final['accuracy'] or 0):>9.2f}%{longest:>13.2f}s  "
              f"{final['param_digest'][:16]}")


def main(argv=None) -> int:
    args = _parse_args(argv)
    work = tempfile.mkdtemp(prefix="ferrosync-churn-")
    url = args.sync or os.path.join(work, "job")
    common = _member_command(args, url)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    procs, metrics = {}, {}

    def start(name: str) -> None:
        metrics[name] = os.path.join(work, f"{name}.jsonl")
        procs[name] = subprocess.Popen([*common, "--metrics", metrics[name]], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)

    began = time.monotonic()
    names = [chr(ord("a") + i) for i in range(args.members)]
    for name in names:
        start(name)
    victim, survivor = names[-1], names[0]
    _wait(lambda: _last_step(metrics[victim]) >= args.kill_at, f"{victim} past step "
          f"{args.kill_at}", args.timeout)
    killed_at = _last_step(metrics[victim])
    procs[victim].send_signal(signal.SIGKILL)
    _wait(lambda: _dropped(metrics[survivor], killed_at, args.members - 1), "the drop",
          args.timeout)
    newcomer = chr(ord("a") + args.members)
    start(newcomer)
    rows = _collect(procs, metrics, began + args.timeout)
    digests = {final["param_digest"] for _, _, final, _, _ in rows if final is not None}
    _print_table(rows)
    ok = all(code == 0 for name, code, *_ in rows if name != victim) and len(digests) == 1
    print(f"killed {victim} at step {killed_at}, started {newcomer} after the drop; "
          f"{'one model' if len(digests) == 1 else f'{len(digests)} DIFFERENT models'}; "
          f"{time.monotonic() - began:.1f} s")
    given = sys.argv[1:] if argv is None else argv
    print("command: python tools/drills/elastic_churn.py " + " ".join(map(shlex.quote, given)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
