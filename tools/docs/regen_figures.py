"""Regenerate the figures of docs/performance.md and docs/train.md: run their documented benchmark
commands three times and write what was measured into the marked places, plus
docs/bench.json and docs/bench.png, with the machine state seen.

    python tools/docs/regen_figures.py                    # ~35-40 min on 2 cores; run it on a
                                                          # quiet machine (nothing else running)
    python tools/docs/regen_figures.py --only strategies  # one section (bench, strategies)
    python tools/docs/regen_figures.py --tiny --out-dir /tmp/figs   # a quick try of the script:
        # every command scaled down, 1 run; writes copies of performance.md, train.md and the
        # JSON/PNG under --out-dir and leaves the repository alone

Places are written between marker comments, `<!-- figures:NAME -->` ...
`<!-- /figures:NAME -->`; a table goes on lines of its own between them.

Section ``bench`` (~17 min): the `python tools/bench/bench.py` lines of the bash block in the
first bash block of docs/performance.md that holds them (``--tiny``: payloads 256x
smaller, 2 iterations). It writes, in docs/performance.md:

* `bench-table`: the table of `average_`'s median time relative to gloo's in the same
  run (per thread setting);
* `sharded-vs-root`: how much faster the sharded reduce is than root at 4 ranks,
  64 MiB (root's median / sharded's, per run);
* `s3-floor`: `average_` on SeaweedFS relative to its raw floor;
* `s3-cpu`, `s3-cpu-bound`, `s3-vs-bound`, `s3-server-floor`, `s3-requests`: from the
  same SeaweedFS rows, the CPU one collective costs (server, ranks), that CPU spread
  over the cores against the floor, `average_` against that bound, the server's CPU
  alone spread over the cores against the floor, and rank 0's requests per collective;
* `emulator-floor`, `emulator-requests`: the same floor ratio and requests on
  fake-gcs-server and Azurite;
* `machine`: cores, how much CPU other processes used during the runs, the load
  average before the first, the commit, and the date.

Each of these is "min–max" over the runs. docs/bench.json gets every run's rows and
the ranges; docs/bench.png is bench.py's drawing of the first command's last run.

Section ``strategies`` (~15-20 min): `python tools/bench/bench_strategies.py` commands of the
demo. Each marked place below is computed from the nearest such command shown before
it in the same file (in a code span, or a line of a bash block, continuations joined),
so the figures always come from the commands shown; each distinct command runs
``--runs`` times (``--tiny``: 60 steps, the first value of each of --ranks,
--sync-every, --seeds and --overlap-steps). The places, in docs/performance.md and
docs/train.md:

* `strategies-table` (performance.md): grad and diloco per number of ranks;
* `strategies-demo` (train.md): every row of the command;
* `strategies-seeds` (train.md): the sentence comparing diloco with grad over seeds;
* `streaming-table` (train.md): every row, with accuracy per seed and bytes per sync;
* `streaming-summary` (both): streaming-diloco's accuracy against diloco's, and its
  bytes per sync, total bytes and number of syncs relative to diloco's;
* `strategies-machine`, `streaming-machine`: the machine line, as for ``bench``.

Training is deterministic for a fixed seed (the same samples, the same arithmetic), so
accuracies, eval losses, byte counts, their ratios and sync counts are written as one
value after checking that every run agrees on it as shown (bytes differ by a few per
run: variable-width fields in small records; that is below the precision shown).
Where runs disagree the range is written instead and the script says so (WARNING),
since the prose around these figures assumes they are exact. Training times vary:
they are written as "min–max s" over the runs. docs/bench.json gets the section's
commands, figures, disagreements and every run's rows under "strategies".

Whether the machine was quiet is measured, not read off the load average (which the
benchmark's own processes raise): the CPU time the whole machine used during a run
(/proc/stat) minus what the benchmark's processes used (this script's waited-for
children). Above 0.15 of a core on average the figures say more about the other load
than about ferrosync, and the script says so. How a run is timed and measured, and how
figures are written between the markers, is ferrosync/testing/figures.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile

from ferrosync.testing.figures import (
    BENCH_DOC,
    FIGURES,
    ROOT,
    STRATEGY_DOCS,
    STRATEGY_FIGURES,
    STRATEGY_MACHINE,
    Check,
    bench_commands,
    by_config,
    figures,
    machine_line,
    machine_state,
    markers,
    shrink,
    shrink_strategies,
    strategy_places,
    timed_run,
    write_between,
)


def run_all(commands: list[list[str]], runs: int, out_dir: str) -> list[dict]:
    results = []
    for run in range(runs):
        for k, command in enumerate(commands):
            out = os.path.join(out_dir, f"run{run}-cmd{k}")
            timing = timed_run([sys.executable, *command[1:], "--out", out],
                               f"[run {run + 1}/{runs}] {' '.join(command)}")
            with open(os.path.join(out, "bench.json")) as f:
                data = json.load(f)
            results.append({"run": run, "command": " ".join(command), "rows": data["rows"],
                            "wire": data.get("wire"), **timing, "out": out})
    return results


def bench_section(texts: dict, report: dict, *, runs: int, tiny: bool, invocation: str,
                  work: str, docs: str) -> None:
    """Run BENCH_DOC's bench commands, write their figures into ``texts[BENCH_DOC]``,
    their runs into ``report`` (docs/bench.json's top level) and bench.png into ``docs``."""
    scale, iters = (256, 2) if tiny else (1, None)
    commands = [shrink(c, scale, iters) for c in bench_commands(texts[BENCH_DOC])]
    state0 = machine_state()
    results = run_all(commands, runs, work)
    figs = figures(results, scale)
    machine = machine_line(results, runs, invocation, state0)
    text = texts[BENCH_DOC]
    for name in FIGURES:
        text = write_between(text, name, figs[name], BENCH_DOC)
    texts[BENCH_DOC] = write_between(text, "machine", machine, BENCH_DOC)
    report.update({"machine": {**state0, "summary": machine},
                   "commands": [" ".join(c) for c in commands],
                   "ranges": figs["ranges"],
                   "runs": [{k: v for k, v in r.items() if k != "out"} for r in results]})
    png = os.path.join(results[-len(commands)]["out"], "bench.png")
    if os.path.exists(png):  # the first command's last run, as bench.py drew it
        shutil.copy(png, os.path.join(docs, "bench.png"))
    print(machine)
    print(figs["bench-table"])


def strategies_section(texts: dict, report: dict, *, runs: int, tiny: bool,
                       invocation: str, work: str) -> None:
    """Run the strategies commands shown in STRATEGY_DOCS and write their figures and
    machine line into ``texts``, their runs into ``report["strategies"]``."""
    places = {doc: strategy_places(texts[doc]) for doc in STRATEGY_DOCS}
    # each distinct command once per run, in the order the documents show them
    commands = list(dict.fromkeys(tuple(c) for found in places.values() for _, c in found))
    shrunk = {c: shrink_strategies(list(c)) if tiny else list(c) for c in commands}
    state0 = machine_state()
    results = []
    for run in range(runs):
        for k, c in enumerate(commands):
            path = os.path.join(work, f"strategies-run{run}-cmd{k}.json")
            timing = timed_run([sys.executable, *shrunk[c][1:], "--json", path],
                               f"[run {run + 1}/{runs}] {shlex.join(shrunk[c])}")
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)["rows"]
            results.append({"run": run, "command": shlex.join(shrunk[c]), "key": c,
                            "rows": rows, **timing})
    machine = machine_line(results, runs, invocation, state0)
    check = Check()
    figs: dict[str, dict[str, str]] = {}
    for doc, found in places.items():
        text = texts[doc]
        for name, c in found:
            configs = by_config([r["rows"] for r in results if r["key"] == tuple(c)])
            figs.setdefault(doc, {})[name] = STRATEGY_FIGURES[name](configs, check)
            text = write_between(text, name, figs[doc][name], doc)
        for name in STRATEGY_MACHINE:
            if name in markers(text):
                text = write_between(text, name, machine, doc)
        texts[doc] = text
    disagreements = list(dict.fromkeys(check.disagreements))
    for d in disagreements:
        print(f"WARNING: runs disagree on a deterministic figure: {d}", flush=True)
    report["strategies"] = {
        "machine": {**state0, "summary": machine},
        "commands": [r["command"] for r in results[:len(commands)]],
        "figures": figs, "disagreements": disagreements,
        "runs": [{k: v for k, v in r.items() if k != "key"} for r in results]}
    print(machine)
    for doc in figs:
        for name, content in figs[doc].items():
            print(f"{doc} {name}:\n{content}")


SECTIONS = ("bench", "strategies")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of every command (3)")
    parser.add_argument("--only", metavar="SECTION[,SECTION]",
                        help=f"run only these sections ({', '.join(SECTIONS)}; default: all)")
    parser.add_argument("--tiny", action="store_true",
                        help="every command scaled down, 1 run: to try the script; "
                        "needs --out-dir")
    parser.add_argument("--out-dir", help="write performance.md, train.md, bench.json and "
                        "bench.png here instead of into the repository")
    args = parser.parse_args(argv)
    if args.tiny and not args.out_dir:
        raise SystemExit("--tiny writes figures that mean nothing: give --out-dir")
    sections = SECTIONS if not args.only else tuple(args.only.split(","))
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only: no section {', '.join(unknown)} "
                         f"(sections: {', '.join(SECTIONS)})")
    runs = 1 if args.tiny else args.runs
    if args.tiny and args.runs != 3:
        runs = args.runs
    invocation = ("python tools/docs/regen_figures.py" + (" --tiny" if args.tiny else "")
                  + (f" --only {args.only}" if args.only else ""))
    texts = {}
    for doc in (BENCH_DOC, *STRATEGY_DOCS):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            texts[doc] = f.read()
    written = dict(texts)
    report = {}
    bench_json = os.path.join(ROOT, "docs", "bench.json")
    if os.path.exists(bench_json):  # the sections not run keep what they wrote last
        with open(bench_json) as f:
            report = json.load(f)
    out_dir = args.out_dir or ROOT
    docs = args.out_dir or os.path.join(ROOT, "docs")
    os.makedirs(docs, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ferrosync-figures-")
    try:
        if "bench" in sections:
            bench_section(texts, report, runs=runs, tiny=args.tiny, invocation=invocation,
                          work=work, docs=docs)
        if "strategies" in sections:
            strategies_section(texts, report, runs=runs, tiny=args.tiny,
                               invocation=invocation, work=work)
        paths = []
        for doc, text in texts.items():
            if text != written[doc] or args.out_dir:
                path = (os.path.join(out_dir, os.path.basename(doc)) if args.out_dir
                        else os.path.join(ROOT, doc))
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                paths.append(path)
        with open(os.path.join(docs, "bench.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {', '.join(paths)}, {docs}/bench.json"
              + (", bench.png" if "bench" in sections else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
