"""Regenerate the README's performance figures: run its documented bench commands three
times and write the ranges measured into the marked places of README.md, plus
docs/bench.json and docs/bench.png, with the machine state seen.

    python tools/regen_figures.py                    # ~17 min on 2 cores; run it on a
                                                     # quiet machine (nothing else running)
    python tools/regen_figures.py --tiny --out-dir /tmp/figs   # a quick try of the script:
        # payloads 256x smaller, 2 iterations, 1 run; writes a copy of README.md and the
        # JSON/PNG under --out-dir and leaves the repository alone

The commands are read from the README itself (the `python tools/bench.py` lines of the
bash block in "Performance"), so the figures always come from the commands shown. The
places written are between marker comments:

* `<!-- figures:bench-table -->` ... `<!-- /figures:bench-table -->`: the table of
  `average_`'s median time relative to gloo's in the same run (per thread setting);
* `<!-- figures:sharded-vs-root -->`: how much faster the sharded reduce is than root at
  4 ranks, 64 MiB (root's median / sharded's, per run);
* `<!-- figures:s3-floor -->`: `average_` on SeaweedFS relative to its raw floor;
* `<!-- figures:emulator-floor -->`: the same on fake-gcs-server and Azurite;
* `<!-- figures:machine -->`: cores, how much CPU other processes used during the
  runs, the load average before the first, the commit, and the date.

Each figure is "min–max×" over the runs. Whether the machine was quiet is measured, not
read off the load average (which the benchmark's own ranks raise): the CPU time the
whole machine used during a run (/proc/stat) minus what the benchmark's processes used
(this script's waited-for children). Above 0.15 of a core on average the figures say
more about the other load than about ferrosync, and the script says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from bench import human, parse_size  # noqa: E402

#: the table's rows: (ranks, payload, backend, label)
TABLE_ROWS = [
    (2, "16MiB", "disk-sharded", "16 MiB"),
    (2, "64MiB", "disk-sharded", "64 MiB"),
    (2, "256MiB", "disk-sharded", "256 MiB"),
    (4, "64MiB", "disk-sharded", "64 MiB, sharded (default)"),
    (4, "64MiB", "disk-root", '64 MiB, `reduce="root"`'),
]
S3_PAYLOADS = ["1MiB", "16MiB", "64MiB"]
#: the GCS and Azure emulators' rows (tools/emulators.py), each against its own floor
EMULATORS = ["gcs-emulator", "azurite"]
EMULATOR_PAYLOADS = ["1MiB", "16MiB"]
THREADS = [("default", "default threading"), ("pinned", "one thread per rank")]
#: above this many cores' worth of CPU used by other processes the machine was not quiet
QUIET_OTHER_CORES = 0.15


def bench_commands(readme: str) -> list[list[str]]:
    """The `python tools/bench.py ...` lines of the README's Performance section."""
    section = readme.split("\n## Performance", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line) for line in block.splitlines()
            if line.startswith("python tools/bench.py")]


def shrink(command: list[str], scale: int, iters: int | None) -> list[str]:
    """--tiny: payloads ``scale`` times smaller, fewer iterations."""
    out = list(command)
    for i, word in enumerate(out[:-1]):
        if word == "--payloads":
            out[i + 1] = ",".join(f"{max(parse_size(p) // scale, 1024)}B"
                                  for p in out[i + 1].split(","))
        if word == "--iters" and iters is not None:
            out[i + 1] = str(iters)
    return out


def machine_state() -> dict:
    return {"cores": len(os.sched_getaffinity(0)), "load_avg": list(os.getloadavg())}


def machine_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat's first
    line: user, nice, system, irq, softirq, steal); None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this script's finished children and everything they waited for:
    the benchmark's own processes (bench.py, its ranks and its servers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_all(commands: list[list[str]], runs: int, out_dir: str) -> list[dict]:
    results = []
    for run in range(runs):
        for k, command in enumerate(commands):
            out = os.path.join(out_dir, f"run{run}-cmd{k}")
            argv = [sys.executable, *command[1:], "--out", out]
            before = machine_state()
            t0 = time.monotonic()
            machine0, ours0 = machine_cpu_seconds(), children_cpu_seconds()
            print(f"[run {run + 1}/{runs}] {' '.join(command)}", flush=True)
            subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            seconds, machine1 = time.monotonic() - t0, machine_cpu_seconds()
            other = None
            if machine0 is not None and machine1 is not None:
                ours = children_cpu_seconds() - ours0
                other = max(0.0, machine1 - machine0 - ours) / seconds
            with open(os.path.join(out, "bench.json")) as f:
                data = json.load(f)
            results.append({"run": run, "command": " ".join(command), "rows": data["rows"],
                            "wire": data.get("wire"), "seconds": seconds,
                            "other_cores": other, "before": before, "out": out})
            if other is not None and other > QUIET_OTHER_CORES:
                print(f"  WARNING: other processes used {other:.2f} of a core on average "
                      f"during this run: not a quiet machine", flush=True)
    return results


def values(results, *, world, payload, backend, threads, key) -> list[float]:
    out = []
    for res in results:
        for r in res["rows"]:
            if (r["world"], r["payload"], r["backend"], r["threads"]) == (
                    world, payload, backend, threads) and r.get(key) is not None:
                out.append(r[key])
    return out


def span(xs: list[float]) -> str:
    if not xs:
        return "—"
    lo, hi = min(xs), max(xs)
    return f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"


def figures(results, scale: int) -> dict:
    def size(p):
        return max(parse_size(p) // scale, 1024)

    table = ["| ranks | payload | " + " | ".join(label for _, label in THREADS) + " |",
             "|---|---|" + "---|" * len(THREADS)]
    ranges = {}
    for world, payload, backend, label in TABLE_ROWS:
        cells = []
        for threads, _ in THREADS:
            xs = values(results, world=world, payload=size(payload), backend=backend,
                        threads=threads, key="vs_gloo")
            ranges[f"{backend} w{world} {payload} {threads} vs gloo"] = xs
            cells.append(span(xs))
        shown = label if scale == 1 else f"{label} (tiny: {human(size(payload))})"
        table.append(f"| {world} | {shown} | " + " | ".join(cells) + " |")
    speedups = []
    for threads, label in THREADS:
        xs = []
        for res in results:
            rows = {(r["backend"], r["threads"], r["world"], r["payload"]): r["p50_ms"]
                    for r in res["rows"]}
            root = rows.get(("disk-root", threads, 4, size("64MiB")))
            sharded = rows.get(("disk-sharded", threads, 4, size("64MiB")))
            if root and sharded:
                xs.append(root / sharded)
        ranges[f"sharded vs root w4 64MiB {threads}"] = xs
        speedups.append(f"{span(xs)} with {label}")
    def vs_floor(backend: str, payloads: list[str]) -> str:
        """``average_`` against the store's own floor at each payload (2 ranks)."""
        cells = []
        for p in payloads:
            xs = values(results, world=2, payload=size(p), backend=backend,
                        threads="default", key="vs_floor")
            ranges[f"{backend} w2 {p} vs floor"] = xs
            cells.append(f"{span(xs)} at {human(size(p))}")
        return ", ".join(cells)

    s3 = vs_floor("s3-seaweed", S3_PAYLOADS)
    emulators = [f"{backend} {vs_floor(backend, EMULATOR_PAYLOADS)}" for backend in EMULATORS]
    return {"bench-table": "\n".join(table), "sharded-vs-root": "; ".join(speedups),
            "s3-floor": s3, "emulator-floor": "; ".join(emulators),
            "ranges": ranges}


#: the marked places of README.md this script writes, besides ``machine``
FIGURES = ("bench-table", "sharded-vs-root", "s3-floor", "emulator-floor")


def write_between(text: str, name: str, content: str) -> str:
    pattern = re.compile(rf"(<!-- figures:{name} -->)(.*?)(<!-- /figures:{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no <!-- figures:{name} --> ... markers")
    sep = "\n" if name == "bench-table" else ""
    return pattern.sub(lambda m: m.group(1) + sep + content + sep + m.group(3), text, count=1)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of every command (3)")
    parser.add_argument("--tiny", action="store_true",
                        help="payloads 256x smaller, 2 iterations, 1 run: to try the script; "
                        "needs --out-dir")
    parser.add_argument("--out-dir", help="write README.md, bench.json and bench.png here "
                        "instead of into the repository")
    args = parser.parse_args(argv)
    if args.tiny and not args.out_dir:
        raise SystemExit("--tiny writes figures that mean nothing: give --out-dir")
    scale, iters, runs = (256, 2, 1) if args.tiny else (1, None, args.runs)
    if args.tiny and args.runs != 3:
        runs = args.runs
    readme_path = os.path.join(ROOT, "README.md")
    with open(readme_path, encoding="utf-8") as f:
        readme = f.read()
    commands = [shrink(c, scale, iters) for c in bench_commands(readme)]
    state0 = machine_state()
    work = tempfile.mkdtemp(prefix="ferrosync-figures-")
    try:
        results = run_all(commands, runs, work)
        figs = figures(results, scale)
        others = [r["other_cores"] for r in results if r["other_cores"] is not None]
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        quiet = all(x <= QUIET_OTHER_CORES for x in others)
        measured = (f"other processes used {min(others):.2f}–{max(others):.2f} of a core "
                    "during the runs" if others else "other processes' CPU not measured "
                    "(no /proc/stat)")
        machine = (f"{runs} run(s) of each command by `python tools/regen_figures.py"
                   f"{' --tiny' if args.tiny else ''}` at {commit()} on {date}: "
                   f"{state0['cores']} cores; {measured}; 1-minute load average "
                   f"{state0['load_avg'][0]:.2f} before the first"
                   + ("" if quiet else " (NOT a quiet machine: rerun before trusting "
                      "these figures)"))
        for name in FIGURES:
            readme = write_between(readme, name, figs[name])
        readme = write_between(readme, "machine", machine)
        out_dir = args.out_dir or ROOT
        docs = args.out_dir or os.path.join(ROOT, "docs")
        os.makedirs(docs, exist_ok=True)
        with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write(readme)
        with open(os.path.join(docs, "bench.json"), "w") as f:
            json.dump({"machine": {**state0, "summary": machine},
                       "commands": [" ".join(c) for c in commands],
                       "ranges": figs["ranges"],
                       "runs": [{k: v for k, v in r.items() if k != "out"} for r in results]},
                      f, indent=1)
        png = os.path.join(results[-len(commands)]["out"], "bench.png")
        if os.path.exists(png):  # the first command's last run, as bench.py drew it
            shutil.copy(png, os.path.join(docs, "bench.png"))
        print(machine)
        print(figs["bench-table"])
        print(f"wrote {os.path.join(out_dir, 'README.md')}, {docs}/bench.json, bench.png")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
