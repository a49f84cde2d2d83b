"""What the benchmarks and drills measure with: payload sizes as text (``16MiB``) and
back, a Linux process's resident set, its peak and its CPU time, a training run's
``FINAL`` record, and a benchmark's JSON report. Standard library only."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time

__all__ = ["MIB", "human", "parse_size", "peak_rss_mb", "process_cpu_s", "reset_peak_rss",
           "ranks_agreed", "rss_mb", "run_final", "save_report"]

MIB = 1 << 20
#: binary units a size may end with (case-insensitive), largest first for ``human``
UNITS = {"GIB": 1 << 30, "MIB": 1 << 20, "KIB": 1 << 10, "B": 1}


def parse_size(text: str) -> int:
    """``"64KiB"``, ``"1.5MiB"``, ``"2GiB"``, ``"512B"`` or ``"4096"`` -> bytes.
    ValueError for anything else."""
    text = text.strip().upper()
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def human(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it: ``"16 MiB"``, ``"3 B"``."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb() -> float:
    """This process's resident set now, in MiB."""
    return _status_mb("VmRSS")


def peak_rss_mb() -> float:
    """This process's peak resident set since the last ``reset_peak_rss``, in MiB.

    Not ``ru_maxrss``: Linux carries that across exec, so a spawned rank would inherit
    the launching process's high-water mark.
    """
    return _status_mb("VmHWM")


def reset_peak_rss() -> None:
    """Set the peak (``VmHWM``) to the current resident set (Linux >= 4.0; elsewhere a
    no-op, and the peak is the process's whole life's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def process_cpu_s(pid: int) -> float:
    """CPU seconds used so far by every thread of process ``pid`` (nanosecond resolution
    from each thread's schedstat; the clock-tick counters in ``stat`` are 10 ms coarse)."""
    total = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass  # the thread ended between the listing and the read
    return total


def run_final(cmd: list[str], *, env: dict, timeout: float | None = None,
              cwd: str | None = None) -> dict:
    """Run ``cmd``, a ``python -m ferrosync.train ...`` command, to its end: its ``FINAL``
    record (the last line of its stdout) plus ``command_s``, the command's wall time.
    RuntimeError naming the command, its exit status and its last lines of stderr where
    it failed or did not end with a ``FINAL`` line."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    command_s = time.perf_counter() - start
    lines = proc.stdout.rstrip("\n").splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("FINAL "):
        tail = "\n".join((proc.stderr.strip().splitlines() or ["(no output)"])[-5:])
        raise RuntimeError(f"{shlex.join(cmd[1:])} exited {proc.returncode}:\n{tail}")
    final = json.loads(lines[-1][len("FINAL "):])
    final["command_s"] = command_s
    return final


def save_report(path: str, report: dict) -> None:
    """Write a benchmark's ``report`` as JSON to ``path``, with the machine it ran on
    (``machine``: Python version, CPUs, platform), and say where."""
    report = {**report, "machine": {"python": platform.python_version(),
                                    "cpus": os.cpu_count(), "platform": platform.platform()}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"saved: {path}")


def ranks_agreed(rows: list[dict], name) -> int:
    """A benchmark's exit status: 1 where the ranks of a row's runs ended with different
    parameters (``ranks_agree`` false: said on stderr, ``name(row)`` naming the row),
    else 0."""
    disagree = [r for r in rows if not r["ranks_agree"]]
    for r in disagree:
        print(f"{name(r)}: ranks ended with DIFFERENT parameters", file=sys.stderr)
    return 1 if disagree else 0
