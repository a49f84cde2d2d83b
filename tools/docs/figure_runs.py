"""How tools/docs/regen_figures.py measures a figure and writes it: each benchmark command
timed with the CPU other processes used meanwhile (a quiet machine is measured, not
assumed), the machine line written next to the figures, "min–max" ranges over runs,
and the marked places of a document (``<!-- figures:NAME -->`` ...
``<!-- /figures:NAME -->``) that figures are written between.
"""

from __future__ import annotations

import datetime
import os
import re
import resource
import subprocess
import time

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
