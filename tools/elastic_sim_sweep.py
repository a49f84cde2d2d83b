"""Run the elastic simulator over many seeds and report every failing one with the
command that replays it (docs/elastic.md#simulation).

    python tools/elastic_sim_sweep.py --seeds 0:1000 [--jobs 2] -- --members 20 --rounds 10 \
        --churn joins=600,leaves=300,kills=300,pauses=120

Everything after ``--`` is passed to ``tools/elastic_sim.py`` (``--seed`` is the
sweep's). Each seed runs in its own process (``--jobs`` at a time). Prints one line per
failing seed, then ``SWEEP {json}`` (seeds, failed, the violations by name, the wall
time); the exit status is 0 only when every seed ran clean.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, "tools", "elastic_sim.py")


def seeds_of(text: str) -> range:
    """``A:B`` (B excluded) or ``N`` (0..N-1)."""
    start, _, stop = text.partition(":")
    return range(int(start), int(stop)) if stop else range(int(start))


def run_seed(seed: int, args: list[str]) -> tuple[int, int, dict | None, str]:
    cmd = [sys.executable, SIM, *args, "--seed", str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SIM ")]
    result = json.loads(lines[-1][4:]) if lines else None
    return seed, proc.returncode, result, proc.stderr.strip().splitlines()[-1:] or [""]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sim_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="elastic_sim_sweep.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", required=True, help="A:B (B excluded) or N (0..N-1)")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(own)
    try:
        seeds = seeds_of(args.seeds)
    except ValueError:
        p.error(f"--seeds: {args.seeds!r} is not A:B or N")
    if "--seed" in sim_args:
        p.error("--seed is the sweep's: give --seeds A:B instead")
    began = time.perf_counter()
    failed, violations = [], Counter()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for seed, code, result, err in pool.map(lambda s: run_seed(s, sim_args), seeds):
            if code == 0:
                continue
            failed.append(seed)
            names = result["violations"] if result else [f"exit {code}"]
            violations.update(names)
            replay = shlex.join(["python", "tools/elastic_sim.py", *sim_args, "--seed",
                                 str(seed)])
            print(f"seed {seed} failed ({', '.join(names)}): {replay}"
                  + (f"  [{err[0]}]" if not result else ""), flush=True)
    print("SWEEP " + json.dumps({"seeds": len(seeds), "failed": failed,
                                 "violations": dict(violations),
                                 "wall_s": round(time.perf_counter() - began, 1),
                                 "command": shlex.join(["python",
                                                        "tools/elastic_sim_sweep.py",
                                                        *argv])}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
