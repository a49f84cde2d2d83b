"""The figures of docs/performance.md and docs/train.md, as ``tools/docs/regen_figures.py``
measures and writes them: each benchmark command timed with the CPU other processes used
meanwhile (a quiet machine is measured, not assumed), the machine line, "min–max" ranges
over runs, the tables and sentences made of the benchmarks' rows, and the marked places
of a document (``<!-- figures:NAME -->`` ... ``<!-- /figures:NAME -->``) they are
written between."""

from __future__ import annotations

import datetime
import os
import re
import resource
import shlex
import subprocess
import time

from ferrosync.testing.measure import human, parse_size

#: the clone this module is part of (the documents' root)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: above this many cores' worth of CPU used by other processes the machine was not quiet
QUIET_OTHER_CORES = 0.15


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


def timed_run(argv: list[str], label: str) -> dict:
    """Run ``argv`` (from the repository root, its stdout discarded) to completion and
    return its wall time, the cores' worth of CPU other processes used meanwhile (None
    without /proc/stat) and the machine state before it. Warns where that machine was
    not quiet; raises CalledProcessError if the command fails."""
    before = machine_state()
    t0 = time.monotonic()
    machine0, ours0 = machine_cpu_seconds(), children_cpu_seconds()
    print(label, flush=True)
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    seconds, machine1 = time.monotonic() - t0, machine_cpu_seconds()
    other = None
    if machine0 is not None and machine1 is not None:
        ours = children_cpu_seconds() - ours0
        other = max(0.0, machine1 - machine0 - ours) / seconds
    if other is not None and other > QUIET_OTHER_CORES:
        print(f"  WARNING: other processes used {other:.2f} of a core on average "
              f"during this run: not a quiet machine", flush=True)
    return {"seconds": seconds, "other_cores": other, "before": before}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_line(results: list[dict], runs: int, invocation: str, state0: dict) -> str:
    """The machine state a section's figures were measured in, as written next to them:
    from its runs' ``other_cores`` and ``state0`` (machine_state() before the first)."""
    others = [r["other_cores"] for r in results if r["other_cores"] is not None]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    quiet = all(x <= QUIET_OTHER_CORES for x in others)
    measured = (f"other processes used {min(others):.2f}–{max(others):.2f} of a core "
                "during the runs" if others else "other processes' CPU not measured "
                "(no /proc/stat)")
    return (f"{runs} run(s) of each command by `{invocation}` at {commit()} on {date}: "
            f"{state0['cores']} cores; {measured}; 1-minute load average "
            f"{state0['load_avg'][0]:.2f} before the first"
            + ("" if quiet else " (NOT a quiet machine: rerun before trusting "
               "these figures)"))


def span(xs: list[float], fmt: str = "{:.2f}", unit: str = "×") -> str:
    """"min–max" of ``xs`` as formatted, one value where both read the same; "—" for
    none. Minus signs are written as such (−), since "–" separates the range."""
    if not xs:
        return "—"
    lo, hi = (fmt.format(x).replace("-", "−") for x in (min(xs), max(xs)))
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def write_between(text: str, name: str, content: str, doc: str = "the document") -> str:
    """``text`` with what is between the first ``name`` markers replaced by ``content``
    (a table, content starting with "|", on lines of its own); SystemExit if ``doc``
    has no such markers."""
    pattern = re.compile(rf"(<!-- figures:{name} -->)(.*?)(<!-- /figures:{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc} has no <!-- figures:{name} --> ... markers")
    sep = "\n" if content.startswith("|") else ""
    return pattern.sub(lambda m: m.group(1) + sep + content + sep + m.group(3), text, count=1)


def markers(text: str) -> list[str]:
    """The names of the marked places in ``text``, in order."""
    return re.findall(r"<!-- figures:([\w-]+) -->", text)


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
    """--tiny: the command with bench_strategies' own ``--tiny`` (60 steps, the first
    value of each list option), so each command trains a handful of short runs."""
    return [*command, "--tiny"]


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
