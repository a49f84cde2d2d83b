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
figures are written between the markers, is tools/docs/figure_runs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import tempfile

if __package__:  # python -m tools.regen_figures, or `from tools import regen_figures`
    from tools import bench_strategies
    from tools.bench import human, parse_size
    from tools.figure_runs import (
        ROOT,
        machine_line,
        machine_state,
        markers,
        span,
        timed_run,
        write_between,
    )
else:  # python tools/docs/regen_figures.py: this directory is sys.path[0], as for any script
    import bench_strategies
    from bench import human, parse_size
    from figure_runs import (
        ROOT,
        machine_line,
        machine_state,
        markers,
        span,
        timed_run,
        write_between,
    )

#: the table's rows: (ranks, payload, backend, label)
TABLE_ROWS = [
    (2, "16MiB", "disk-sharded", "16 MiB"),
    (2, "64MiB", "disk-sharded", "64 MiB"),
    (2, "256MiB", "disk-sharded", "256 MiB"),
    (4, "64MiB", "disk-sharded", "64 MiB, sharded (default)"),
    (4, "64MiB", "disk-root", '64 MiB, `reduce="root"`'),
]
S3_PAYLOADS = ["1MiB", "16MiB", "64MiB"]
#: the GCS and Azure emulators' rows (ferrosync/testing/emulators.py), each against its own floor
EMULATORS = ["gcs-emulator", "azurite"]
EMULATOR_PAYLOADS = ["1MiB", "16MiB"]
THREADS = [("default", "default threading"), ("pinned", "one thread per rank")]


def bench_commands(text: str) -> list[list[str]]:
    """The `python tools/bench/bench.py ...` lines of the first bash block of ``text`` (BENCH_DOC)
    that holds any."""
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = [shlex.split(line) for line in block.splitlines()
                 if line.startswith("python tools/bench/bench.py")]
        if lines:
            return lines
    raise SystemExit(f"{BENCH_DOC} has no bash block of python tools/bench/bench.py commands")


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


def values(results, *, world, payload, backend, threads, key) -> list[float]:
    """``key`` of the matching row of every run: a row field, or a function of the row."""
    out = []
    for res in results:
        for r in res["rows"]:
            if (r["world"], r["payload"], r["backend"], r["threads"]) == (
                    world, payload, backend, threads):
                x = key(r) if callable(key) else r.get(key)
                if x is not None:
                    out.append(x)
    return out


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

    def per_payload(backend: str, payloads: list[str], key, what: str,
                    fmt: str = "{:.2f}", unit: str = "×") -> list[str]:
        """``key`` of 2 ranks, default threading, at each payload: "range at size"."""
        cells = []
        for p in payloads:
            xs = values(results, world=2, payload=size(p), backend=backend,
                        threads="default", key=key)
            ranges[f"{backend} w2 {p} {what}"] = xs
            cells.append(f"{span(xs, fmt, unit)} at {human(size(p))}")
        return cells

    def vs_floor(backend: str, payloads: list[str]) -> str:
        """``average_`` against the store's own floor at each payload (2 ranks)."""
        return ", ".join(per_payload(backend, payloads, "vs_floor", "vs floor"))

    def requests(backend: str, payloads: list[str]) -> str:
        return ", ".join(per_payload(backend, payloads, "requests_rank0",
                                     "requests per collective", "{:.1f}", ""))

    s3 = vs_floor("s3-seaweed", S3_PAYLOADS)
    emulators = [f"{backend} {vs_floor(backend, EMULATOR_PAYLOADS)}" for backend in EMULATORS]
    # the CPU one collective costs on SeaweedFS, whose server shares the machine's cores
    cpu = []
    for p in S3_PAYLOADS:
        spans = []
        for key in ("server_cpu_ms", "ranks_cpu_ms"):
            xs = values(results, world=2, payload=size(p), backend="s3-seaweed",
                        threads="default", key=key)
            ranges[f"s3-seaweed w2 {p} {key}"] = xs
            spans.append(span(xs, "{:.0f}", ""))
        cpu.append(f"{spans[0]} + {spans[1]} ms at {human(size(p))}")
    server_alone = per_payload(
        "s3-seaweed", S3_PAYLOADS,
        lambda r: (r["server_cpu_ms"] / r["cores"] / r["floor_ms"]
                   if r.get("server_cpu_ms") is not None and r.get("cores") else None),
        "server CPU over the cores vs floor")
    return {"bench-table": "\n".join(table), "sharded-vs-root": "; ".join(speedups),
            "s3-floor": s3, "emulator-floor": "; ".join(emulators),
            "s3-cpu": ", ".join(cpu),
            "s3-cpu-bound": ", ".join(per_payload("s3-seaweed", S3_PAYLOADS,
                                                  "cpu_bound_vs_floor", "CPU bound vs floor")),
            "s3-vs-bound": ", ".join(per_payload("s3-seaweed", S3_PAYLOADS, "vs_cpu_bound",
                                                 "vs CPU bound")),
            "s3-server-floor": ", ".join(server_alone),
            "s3-requests": requests("s3-seaweed", S3_PAYLOADS),
            "emulator-requests": "; ".join(f"{backend} {requests(backend, EMULATOR_PAYLOADS)}"
                                           for backend in EMULATORS),
            "ranges": ranges}


#: the document whose bench commands section ``bench`` runs, and whose figures it writes
BENCH_DOC = "docs/performance.md"
#: the marked places of BENCH_DOC the bench section writes, besides ``machine``
FIGURES = ("bench-table", "sharded-vs-root", "s3-floor", "s3-cpu", "s3-cpu-bound",
           "s3-vs-bound", "s3-server-floor", "s3-requests", "emulator-floor",
           "emulator-requests")


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


# --- section "strategies": tools/bench/bench_strategies.py on the demo -----------------------

#: the documents holding strategies figures (paths from the repository root)
STRATEGY_DOCS = ("docs/performance.md", "docs/train.md")
#: the places that get the machine line of the strategies runs
STRATEGY_MACHINE = ("strategies-machine", "streaming-machine")
#: a bench_strategies command in a code span, or on a line of its own (a bash block)
_STRATEGY_COMMAND = re.compile(
    r"`(python tools/bench/bench_strategies\.py[^`]*)`"
    r"|^(python tools/bench/bench_strategies\.py.*)$", re.M)


def strategy_places(text: str) -> list[tuple[str, list[str]]]:
    """(marker name, command) for every strategies figure marked in ``text`` (the names
    of STRATEGY_FIGURES): the command is the nearest `python tools/bench/bench_strategies.py`
    one shown before the marker, as shell words. SystemExit where there is none."""
    joined = re.sub(r"\\\n\s*", " ", text)  # a bash line continued with "\"
    commands = [(m.start(), shlex.split(m.group(1) or m.group(2)))
                for m in _STRATEGY_COMMAND.finditer(joined)]
    places = []
    for m in re.finditer(r"<!-- figures:([\w-]+) -->", joined):
        if m.group(1) not in STRATEGY_FIGURES:
            continue
        before = [c for at, c in commands if at < m.start()]
        if not before:
            raise SystemExit(f"<!-- figures:{m.group(1)} --> has no `python "
                             "tools/bench/bench_strategies.py ...` command shown before it")
        places.append((m.group(1), before[-1]))
    return places


def shrink_strategies(command: list[str]) -> list[str]:
    """--tiny: 60 steps and the first value of each list option (the command's own, or
    bench_strategies' default), so each command trains a handful of short runs."""
    given = bench_strategies.parse_args(command[2:])
    out = list(command)
    for flag in ("ranks", "sync_every", "seeds", "overlap_steps"):
        out += [f"--{flag.replace('_', '-')}", str(getattr(given, flag)[0])]
    return out + ["--train-arg=--steps=60"]


def config(row: dict) -> tuple:
    """What identifies a bench_strategies row within one command's output."""
    return (row["ranks"], row["strategy"], row["sync_every"], row.get("fragments"),
            row.get("overlap_steps"))


def by_config(runs: list[list[dict]]) -> list[list[dict]]:
    """Each configuration's row from every run (a list per configuration, in the first
    run's order). ValueError if the runs did not produce the same configurations."""
    keyed = [{config(r): r for r in rows} for rows in runs]
    if any(k.keys() != keyed[0].keys() for k in keyed):
        raise ValueError("the runs of one command produced different configurations")
    return [[k[key] for k in keyed] for key in keyed[0]]


class Check:
    """Formats one figure across runs, collecting where deterministic values disagree."""

    def __init__(self) -> None:
        self.disagreements: list[str] = []

    def exact(self, rows: list[dict], get, fmt: str, unit: str, what: str) -> str:
        """A value every run should produce as shown (deterministic training): that value,
        or, where runs disagree, their range (noted in ``disagreements``)."""
        xs = [get(r) for r in rows]
        if any(x is None for x in xs):
            return "—"
        text = span(xs, fmt, unit)
        if len({fmt.format(x) for x in xs}) > 1:
            self.disagreements.append(f"{what}: {text} over {len(xs)} runs")
        return text

    @staticmethod
    def varying(rows: list[dict], get, fmt: str, unit: str) -> str:
        """A value that varies from run to run (a wall time): "min–max" over the runs."""
        return span([get(r) for r in rows], fmt, unit)


def _name(rows: list[dict]) -> str:
    r = rows[0]
    h = "" if r["sync_every"] is None else f" H={r['sync_every']}"
    frag = f" F/τ={r['fragments']}/{r['overlap_steps']}" if "fragments" in r else ""
    return f"{r['ranks']} ranks {r['strategy']}{h}{frag}"


def _accuracy(check: Check, rows) -> str:
    return check.exact(rows, lambda r: None if r["accuracy"] is None
                       else 100 * r["accuracy"], "{:.2f}", " %", f"{_name(rows)} accuracy")


def _vs_grad(check: Check, rows) -> str:
    if rows[0]["strategy"] == "grad":
        return "—"
    return check.exact(rows, lambda r: r.get("accuracy_vs_grad_pp"), "{:+.2f}", " pp",
                       f"{_name(rows)} accuracy vs grad")


def _fewer(check: Check, rows, unit: str = "×") -> str:
    if rows[0]["strategy"] == "grad":
        return "—"
    return check.exact(rows, lambda r: r.get("bytes_vs_grad"), "{:.1f}", unit,
                       f"{_name(rows)} bytes vs grad")


def _written(check: Check, rows, unit: str = " MB") -> str:
    return check.exact(rows, lambda r: r["bytes_written_per_rank"] / 1e6, "{:.2f}", unit,
                       f"{_name(rows)} bytes written per rank")


def _syncs(check: Check, rows) -> str:
    return check.exact(rows, lambda r: r["syncs"], "{:,}", "", f"{_name(rows)} syncs")


def _train_time(rows) -> str:
    return Check.varying(rows, lambda r: r["train_wall_s"], "{:.1f}", " s")


def _one_ranks(configs: list[list[dict]], name: str) -> None:
    if len({rows[0]["ranks"] for rows in configs}) > 1:
        raise SystemExit(f"<!-- figures:{name} --> describes one number of ranks: give "
                         "its command one --ranks value")


def demo_table(configs: list[list[dict]], check: Check) -> str:
    """`strategies-demo`: every configuration of the command, one row each."""
    lines = ["| ranks | strategy | H | accuracy | vs grad | training time | written per rank "
             "| fewer bytes than grad | syncs |", "|---|---|---|---|---|---|---|---|---|"]
    for rows in configs:
        r = rows[0]
        h = "—" if r["sync_every"] is None else str(r["sync_every"])
        lines.append(f"| {r['ranks']} | {r['strategy']} | {h} | {_accuracy(check, rows)} | "
                     f"{_vs_grad(check, rows)} | {_train_time(rows)} | "
                     f"{_written(check, rows)} | {_fewer(check, rows)} | "
                     f"{_syncs(check, rows)} |")
    return "\n".join(lines)


def readme_table(configs: list[list[dict]], check: Check) -> str:
    """`strategies-table`: per number of ranks, grad's row and diloco's H values in one."""
    lines = ["| ranks | strategy | accuracy | bytes written per rank | fewer bytes than grad |",
             "|---|---|---|---|---|"]
    for ranks in dict.fromkeys(rows[0]["ranks"] for rows in configs):
        mine = [rows for rows in configs if rows[0]["ranks"] == ranks]
        for rows in mine:
            if rows[0]["strategy"] == "grad":
                lines.append(f"| {ranks} | grad | {_accuracy(check, rows)} | "
                             f"{_written(check, rows)} | — |")
        diloco = [rows for rows in mine if rows[0]["strategy"] == "diloco"]
        if diloco:
            hs = " / ".join(str(rows[0]["sync_every"]) for rows in diloco)
            acc = " / ".join(_accuracy(check, rows).removesuffix(" %") for rows in diloco)
            written = " / ".join(_written(check, rows, "") for rows in diloco)
            fewer = " / ".join(_fewer(check, rows) for rows in diloco)
            lines.append(f"| {ranks} | diloco, H={hs} | {acc} % | {written} MB | {fewer} |")
    return "\n".join(lines)


def _per_seed_pp(check: Check, rows, grad) -> str:
    """``rows``' accuracy minus grad's, seed by seed, "a / b / c pp"."""
    out = []
    for i, seed in enumerate(rows[0]["seeds"]):
        pairs = list(zip(rows, grad))
        out.append(check.exact(
            pairs, lambda p, i=i: 100 * (p[0]["accuracy_per_seed"][i]
                                         - p[1]["accuracy_per_seed"][i]),
            "{:+.1f}", "", f"{_name(rows)} seed {seed} vs grad"))
    return " / ".join(out) + " pp"


def seeds_sentence(configs: list[list[dict]], check: Check) -> str:
    """`strategies-seeds`: grad's accuracy, then each diloco H's, its difference from
    grad (mean, and per seed) and how many times fewer bytes it wrote."""
    _one_ranks(configs, "strategies-seeds")
    grad = next(rows for rows in configs if rows[0]["strategy"] == "grad")
    seeds = ("seeds " if len(grad[0]["seeds"]) > 1 else "seed ") + " / ".join(
        str(s) for s in grad[0]["seeds"])
    parts = []
    for rows in configs:
        if rows[0]["strategy"] != "diloco":
            continue
        parts.append(f"H = {rows[0]['sync_every']} {_accuracy(check, rows)} "
                     f"({_vs_grad(check, rows)}, {_fewer(check, rows)} fewer bytes; "
                     f"{seeds}: {_per_seed_pp(check, rows, grad)})")
    return f"grad {_accuracy(check, grad)}, diloco " + ", ".join(parts)


def streaming_table(configs: list[list[dict]], check: Check) -> str:
    """`streaming-table`: every configuration, accuracy per seed, bytes per sync."""
    _one_ranks(configs, "streaming-table")
    seeds = configs[0][0]["seeds"]
    shown = (f"seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}")
    lines = [f"| strategy | F/τ | accuracy ({shown}) | vs grad | eval loss | written per rank "
             "| written per sync | syncs | training time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rows in configs:
        r = rows[0]
        frag = f"{r['fragments']}/{r['overlap_steps']}" if "fragments" in r else "—"
        acc = _accuracy(check, rows)
        if len(seeds) > 1:
            acc += " (" + ", ".join(
                check.exact(rows, lambda x, i=i: 100 * x["accuracy_per_seed"][i], "{:.2f}", "",
                            f"{_name(rows)} seed {seed} accuracy")
                for i, seed in enumerate(seeds)) + ")"
        loss = check.exact(rows, lambda x: x["eval_loss"], "{:.4f}", "",
                           f"{_name(rows)} eval loss")
        per_sync = check.exact(rows, lambda x: x["bytes_written_per_sync"] / 1e3, "{:.1f}",
                               " kB", f"{_name(rows)} bytes per sync")
        lines.append(f"| {r['strategy']} | {frag} | {acc} | {_vs_grad(check, rows)} | {loss} | "
                     f"{_written(check, rows)} | {per_sync} | {_syncs(check, rows)} | "
                     f"{_train_time(rows)} |")
    return "\n".join(lines)


def streaming_summary(configs: list[list[dict]], check: Check) -> str:
    """`streaming-summary`: streaming-diloco's accuracy (per F/τ) against diloco's, and
    relative to diloco its bytes per sync, total bytes and syncs (one value where every
    F/τ gives the same)."""
    _one_ranks(configs, "streaming-summary")
    diloco = next(rows for rows in configs if rows[0]["strategy"] == "diloco")
    streaming = [rows for rows in configs if rows[0]["strategy"] == "streaming-diloco"]
    if not streaming:
        raise SystemExit("<!-- figures:streaming-summary --> needs streaming-diloco rows")

    def relative(get, fmt: str, unit: str, what: str) -> str:
        cells = [(f"{rows[0]['fragments']}/{rows[0]['overlap_steps']}",
                  check.exact(list(zip(rows, diloco)), get, fmt, unit,
                              f"{_name(rows)} {what}")) for rows in streaming]
        if len({c for _, c in cells}) == 1:
            return cells[0][1]
        return ", ".join(f"{c} ({label})" for label, c in cells)

    acc = ", ".join(f"{_accuracy(check, rows)} (F/τ {rows[0]['fragments']}/"
                    f"{rows[0]['overlap_steps']})" for rows in streaming)
    per_sync = relative(lambda p: p[1]["bytes_written_per_sync"] / p[0]["bytes_written_per_sync"],
                        "{:.1f}", "×", "bytes per sync vs diloco")
    total = relative(lambda p: 100 * (p[0]["bytes_written_per_rank"]
                                      / p[1]["bytes_written_per_rank"] - 1),
                     "{:+.0f}", " %", "bytes vs diloco")
    syncs = relative(lambda p: p[0]["syncs"] / p[1]["syncs"], "{:.1f}", "×", "syncs vs diloco")
    return (f"{acc} against `diloco`'s {_accuracy(check, diloco)}, with {per_sync} fewer "
            f"bytes per sync ({total} in total) over {syncs} as many syncs")


#: the strategies figures: marker name -> what writes it from the command's rows
STRATEGY_FIGURES = {"strategies-table": readme_table, "strategies-demo": demo_table,
                    "strategies-seeds": seeds_sentence, "streaming-table": streaming_table,
                    "streaming-summary": streaming_summary}


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
