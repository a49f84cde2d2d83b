"""Two ``python -m ferrosync.train --elastic`` members started by hand on this host, as a
user following the README's spot recipe locally: training wall time with default
threading (ferrosync sizes torch's pool to each process's share of the cores) against
``OMP_NUM_THREADS=1`` (pinned), side by side, ``--runs`` times each.

    python tools/bench/bench_threads.py --runs 3 --steps 3000

Prints every run's ``wall_s`` (the FINAL line's training wall time, the larger of the
two members'), the range per mode, the ratio default/pinned, the machine's cores and
load average, and the command of one member.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def member_command(sync: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "ferrosync.train", "--elastic", "--sync", sync,
            "--min-ranks", "2", "--steps", str(steps), "--strategy", "diloco",
            "--no-progress"]


def one_run(steps: int, pinned: bool) -> float:
    """Start two members at once; the larger of their FINAL wall_s."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for name in ("OMP_NUM_THREADS", "FERROSYNC_JOB", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "FERROSYNC_URL"):
        env.pop(name, None)
    if pinned:
        env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as sync:
        procs = [subprocess.Popen(member_command(sync, steps), env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(2)]
        walls = []
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"a member failed ({proc.returncode}): {err[-2000:]}")
            final = [line for line in out.splitlines() if line.startswith("FINAL ")][-1]
            walls.append(json.loads(final[len("FINAL "):])["wall_s"])
    return max(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"default": [], "pinned": []}
    for _ in range(args.runs):  # interleaved, so a change in the machine's load hits both
        for mode in results:
            wall = one_run(args.steps, pinned=mode == "pinned")
            results[mode].append(wall)
            print(f"{mode:8s} wall_s {wall:7.2f}", flush=True)
    lo_d, hi_d = min(results["default"]), max(results["default"])
    lo_p, hi_p = min(results["pinned"]), max(results["pinned"])
    ratio = statistics.median(results["default"]) / statistics.median(results["pinned"])
    print(f"default (no OMP_NUM_THREADS): {lo_d:.2f}-{hi_d:.2f} s; "
          f"OMP_NUM_THREADS=1: {lo_p:.2f}-{hi_p:.2f} s; ratio of medians {ratio:.2f}x")
    print(f"cores {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("member command: " + " ".join(member_command("DIR", args.steps)) + "  (twice)")
    print("command: python tools/bench/bench_threads.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
