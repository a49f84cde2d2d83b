"""Quality and bytes of ``wire_dtype`` float32, int8 and topk under DiLoCo, side by side.

    python tools/bench/bench_topk.py                       # both tasks, 3 wires, 3 seeds
    python tools/bench/bench_topk.py --tasks wide --seeds 0 --steps 120 --sync-every 20
    python tools/bench/bench_topk.py --json topk.json      # also save every run's numbers

Every run is ``python -m ferrosync.train --nproc 2 --strategy diloco`` through a
temporary directory, one wire at a time, with the same task, seed, steps and
cadence, so the held-out numbers compare at equal steps. The tasks
(``ferrosync/train/tasks.py``): ``wide``, the goodput bench's (tools/bench/bench_goodput.py),
and ``lm``, a small transformer predicting the next byte of the Python standard
library's own source (nothing downloaded). DiLoCo's outer step is each wire's default
(0.7 / Nesterov 0.9; topk: SparseLoCo's plain SGD at lr 1), unless ``--train-arg``
sets it.

For each task and wire it prints, as mean and range over the seeds:

* bytes per sync: what one rank wrote plus read in one sync (FINAL's ``sync_bytes`` /
  ``syncs``: every object of the sync, headers and control records included, as the
  storage layer counts them; HTTP framing is not in it) and its ratio to float32's;
* held-out loss and accuracy after the same steps;
* compute fraction at each ``--links`` RATE/RTT, *modelled* from those numbers (not
  run through the slow-link proxy: tools/bench/bench_goodput.py does that, minutes per
  point): a sync blocks for ``8 * bytes / rate + (ranks + 1) * rtt`` (this rank's
  bytes at the link's rate; the round trips of the gather reduce that an object store
  uses at 2 ranks: one PUT, one GET per other rank, one poll that finds it missing),
  between windows of the compute time measured here, so fraction = compute /
  (compute + syncs * that).

``--from-json PATH`` prints the table again from a saved ``--json`` file (no runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TASKS = {
    "wide": ["--model", "ferrosync.train.tasks:wide_model",
             "--data", "ferrosync.train.tasks:wide_data", "--batch-size", "768",
             "--lr", "0.1"],
    "lm": ["--model", "ferrosync.train.tasks:lm_model",
           "--data", "ferrosync.train.tasks:lm_data", "--batch-size", "32",
           "--optimizer", "adamw", "--lr", "3e-3"],
}
WIRES = ["float32", "int8", "topk"]
LINKS = ["100Mbit/50ms", "10Mbit/100ms"]


def parse_link(text: str) -> tuple[str, float, float]:
    """``"100Mbit/50ms"`` -> (text, bits per second, seconds)."""
    from ferrosync.testing.wan_proxy import parse_link as wan_link

    try:
        rate_bps, rtt_s = wan_link(text)
        if rate_bps is None:
            raise ValueError(f"link {text!r}: a rate is needed here, e.g. 10Mbit/100ms")
        return text, rate_bps, rtt_s
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS),
                   help="tasks to run (default: lm wide)")
    p.add_argument("--wires", nargs="+", choices=WIRES, default=WIRES,
                   help="wire dtypes (default: float32 int8 topk); float32 is the baseline")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="seeds (default 0 1 2)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run "
                   "(default 300)")
    p.add_argument("--sync-every", type=int, default=30, metavar="H",
                   help="DiLoCo's inner steps per sync (default 30, its default)")
    p.add_argument("--links", nargs="+", type=parse_link, default=[parse_link(x) for x in LINKS],
                   metavar="RATE/RTT", help=f"links to model (default: {' '.join(LINKS)})")
    p.add_argument("--train-arg", action="append", default=[], metavar="FLAG",
                   help="extra trainer flag for every run (repeat; e.g. --train-arg=--seed)")
    p.add_argument("--json", metavar="PATH", help="save every run's numbers here")
    p.add_argument("--from-json", metavar="PATH",
                   help="print the table of a saved --json file instead of running")
    return p.parse_args(argv)


def run_one(task: str, wire: str, seed: int, args) -> dict:
    """One training run; its FINAL record's numbers."""
    from ferrosync.testing.measure import run_final  # here: the parent imports no torch

    with tempfile.TemporaryDirectory(prefix="bench-topk-") as where:
        cmd = [sys.executable, "-m", "ferrosync.train", "--nproc", str(RANKS), "--sync",
               os.path.join(where, "run"), *TASKS[task], "--strategy", "diloco",
               "--sync-every", str(args.sync_every), "--steps", str(args.steps),
               "--seed", str(seed), "--no-progress", "--sync-option", f"wire_dtype={wire}",
               *args.train_arg]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        try:
            final = run_final(cmd, env=env, cwd=where)
        except RuntimeError as exc:
            raise SystemExit(f"run failed: {exc}") from None
    if not final["ranks_agree"]:
        raise SystemExit(f"ranks disagree: {shlex.join(cmd)}")
    syncs = max(1, final["syncs"])
    return {"task": task, "wire": wire, "seed": seed, "syncs": final["syncs"],
            "bytes_per_sync": final["sync_bytes"] / syncs,
            # the requests of the syncs: the run's collectives less the start's few
            "requests_per_sync": final["requests"] / syncs,
            "accuracy": final["accuracy"], "eval_loss": final["eval_loss"],
            "compute_s": final["compute_s"], "wall_s": final["wall_s"],
            "digest": final["param_digest"]}


RANKS = 2


def modelled_fraction(run: dict, rate_bps: float, rtt_s: float) -> float:
    """Compute / (compute + the syncs' modelled blocking time) at one link."""
    sync_s = 8 * run["bytes_per_sync"] / rate_bps + (RANKS + 1) * rtt_s
    return run["compute_s"] / (run["compute_s"] + run["syncs"] * sync_s)


def _spread(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(runs: list[dict], args) -> list[str]:
    links = [name for name, _, _ in args.links]
    head = ["task", "wire", "bytes/sync", "vs float32", "held-out acc", "held-out loss",
            *[f"compute @ {name}" for name in links]]
    rows = [head, ["---"] * len(head)]
    for task in args.tasks:
        base = [r["bytes_per_sync"] for r in runs if r["task"] == task
                and r["wire"] == "float32"]
        for wire in args.wires:
            mine = [r for r in runs if r["task"] == task and r["wire"] == wire]
            nbytes = statistics.fmean(r["bytes_per_sync"] for r in mine)
            ratio = f"{statistics.fmean(base) / nbytes:.1f}x fewer" if base else "-"
            fractions = [_spread([modelled_fraction(r, rate, rtt) for r in mine], ".1%")
                         for _, rate, rtt in args.links]
            rows.append([task, wire, f"{nbytes / 1e3:,.1f} kB", ratio,
                         _spread([r["accuracy"] for r in mine], ".4f"),
                         _spread([r["eval_loss"] for r in mine], ".4f"), *fractions])
    return ["| " + " | ".join(row) + " |" for row in rows]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            saved = json.load(f)
        runs = saved["runs"]
        args.tasks = list(dict.fromkeys(r["task"] for r in runs))
        args.wires = list(dict.fromkeys(r["wire"] for r in runs))
        print("\n".join(table(runs, args)))
        print(f"\nfrom {args.from_json}: {saved['args']}")
        return 0
    started = time.time()
    runs = []
    for task in args.tasks:
        for seed in args.seeds:
            for wire in args.wires:
                run = run_one(task, wire, seed, args)
                runs.append(run)
                print(f"{task} {wire} seed {seed}: acc {run['accuracy']:.4f} loss "
                      f"{run['eval_loss']:.4f} {run['bytes_per_sync']:,.0f} B/sync "
                      f"({run['wall_s']:.0f} s)", flush=True)
    print()
    print("\n".join(table(runs, args)))
    print()
    print(f"2 ranks, DiLoCo, {args.steps} steps, H = {args.sync_every}, seeds "
          f"{' '.join(map(str, args.seeds))}; {time.time() - started:.0f} s in all")
    print("command: python tools/bench/bench_topk.py " + shlex.join(argv if argv is not None
                                                              else sys.argv[1:]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args) | {"links": links_of(args)}, "runs": runs}, f,
                      indent=1)
    return 0


def links_of(args) -> list[str]:
    return [name for name, _, _ in args.links]


if __name__ == "__main__":
    sys.exit(main())
