"""Regenerate the sample outputs in the docs from real runs on this machine.

    python tools/docs/doc_outputs.py                 # every sample below
    python tools/docs/doc_outputs.py train doctor    # some of them

* ``train``: docs/train.md's quick-start run, ``python -m ferrosync.train --nproc 2``
  (the FINAL line abbreviated to the keys the sample shows);
* ``doctor``: docs/operations.md's ``ferrosync doctor`` on a fresh local directory;
* ``ops``: docs/operations.md's ``ferrosync inspect`` and ``ferrosync gc --dry-run`` on a
  directory holding a finished job, a job whose rank 1 raised at collective 5 (an
  injected fault, ``FERROSYNC_FAULTS``), a job whose ranks were SIGKILLed (dead) and a
  job running while the tools watch it (live).

Each sample is the ```text block whose first line starts as given below; the rest of the
document is untouched. Local paths are shown as the docs' (``/mnt/nfs/exp7``,
``/mnt/scratch/exp7``): the runs use a temporary directory and the script replaces its
path in the output. ``tests/test_docs.py`` checks each sample against a real run (the
kinds of line, the summary rows, the step count, accuracy within a point), so a sample
that no longer matches the code fails the suite until this script is rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the FINAL keys the train.md sample shows, then "..."
FINAL_SHOWN = (("accuracy", "bytes_read", "bytes_written"), ("ranks_agree", "steps"))


def _env() -> dict:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FERROSYNC_URL", "FERROSYNC_JOB"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(*args: str, timeout: float = 600) -> str:
    """stdout and stderr as a terminal shows them (a progress bar: its last state)."""
    result = subprocess.run([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(),
                            timeout=timeout, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"`{' '.join(args)}` exited {result.returncode}:\n"
                         f"{result.stdout[-4000:]}")
    return "\n".join(line.rstrip("\r").split("\r")[-1] for line in result.stdout.split("\n"))


def replace_sample(doc: str, first_line: str, text: str) -> None:
    """Replace the body of the ```text block of ``doc`` whose first line starts with
    ``first_line``."""
    path = os.path.join(ROOT, doc)
    with open(path, encoding="utf-8") as f:
        content = f.read()
    pattern = re.compile(r"(```text\n)(" + re.escape(first_line) + r".*?\n)(```)", re.S)
    new, n = pattern.subn(lambda m: m.group(1) + text.rstrip("\n") + "\n" + m.group(3),
                          content, count=1)
    if n != 1:
        raise SystemExit(f"{doc}: no ```text block starting with {first_line!r}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"{doc}: sample starting {first_line!r} rewritten")


def _abbreviate_final(line: str) -> str:
    record = json.loads(line[len("FINAL "):])
    head, tail = FINAL_SHOWN
    parts = [f'"{k}":{json.dumps(record[k])}' for k in head] + ["..."]
    parts += [f'"{k}":{json.dumps(record[k])}' for k in tail] + ["..."]
    return "FINAL {" + ",".join(parts) + "}"


def train_sample() -> None:
    out = _run("-m", "ferrosync.train", "--nproc", "2")
    lines = [line for line in out.rstrip("\n").splitlines() if line.strip()]
    bars = [i for i, line in enumerate(lines) if line.startswith("[rank 0] train:")]
    lines = [line for i, line in enumerate(lines) if i not in bars[:-1]]  # its last state
    lines[-1] = _abbreviate_final(lines[-1])
    replace_sample("docs/train.md", "ferrosync.train: started", "\n".join(lines))


def doctor_sample() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "exp7")
        out = _run("-m", "ferrosync", "doctor", where)
    shown = "/mnt/scratch/exp7"
    replace_sample("docs/operations.md", "$ ferrosync doctor",
                   f"$ ferrosync doctor {shown}\n" + out.replace(where, shown))


def _heartbeats(sync: str) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(sync) for f in fs
            if f in ("hb.r0", "hb.r1")}


def _start_job(sync: str, steps: int) -> tuple[subprocess.Popen, list[int]]:
    """A 2-rank demo job on ``sync``; returns once both its ranks are training."""
    before = _heartbeats(sync) if os.path.isdir(sync) else set()
    proc = subprocess.Popen([sys.executable, "-m", "ferrosync.train", "--nproc", "2",
                             "--sync", sync, "--steps", str(steps), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=ROOT)
    first = proc.stdout.readline()
    pids = [int(p) for p in re.findall(r"pid (\d+)", first)]
    if len(pids) != 2:
        proc.kill()
        raise SystemExit(f"unexpected first line from the launcher: {first!r}")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # both heartbeats written: training has begun
        if len(_heartbeats(sync) - before) == 2:
            time.sleep(1.0)  # a few beats and collectives in
            return proc, pids
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the job did not start within 120 s")


def ops_samples() -> None:
    shown = "/mnt/nfs/exp7"
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "exp7")
        _run("-m", "ferrosync.train", "--nproc", "2", "--sync", where, "--steps", "50",
             "--no-progress")                                           # finished
        failing = subprocess.run(                                       # finished: aborted
            [sys.executable, "-m", "ferrosync.train", "--nproc", "2", "--sync", where,
             "--steps", "50", "--no-progress"], capture_output=True, text=True, cwd=ROOT,
            env={**_env(), "FERROSYNC_FAULTS": json.dumps(
                [{"rank": 1, "collective": 5, "phase": "write", "action": "raise"}])})
        if failing.returncode == 0:
            raise SystemExit("the job with an injected fault did not fail")
        launcher, pids = _start_job(where, 10**6)                       # dead: SIGKILLed
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        live, _ = _start_job(where, 10**6)                              # live
        try:
            inspect = _run("-m", "ferrosync", "inspect", where)
            gc = _run("-m", "ferrosync", "gc", where, "--dry-run")
        finally:
            live.send_signal(signal.SIGINT)
            live.communicate(timeout=60)
    replace_sample("docs/operations.md", "$ ferrosync inspect",
                   f"$ ferrosync inspect {shown}\n" + inspect.replace(where, shown))
    replace_sample("docs/operations.md", "$ ferrosync gc",
                   f"$ ferrosync gc {shown} --dry-run\n" + gc.replace(where, shown))


SAMPLES = {"train": train_sample, "doctor": doctor_sample, "ops": ops_samples}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", nargs="*", metavar="SAMPLE",
                        help=f"the samples to regenerate ({', '.join(SAMPLES)}; default: all)")
    names = parser.parse_args(argv).samples or list(SAMPLES)
    unknown = [n for n in names if n not in SAMPLES]
    if unknown:
        parser.error(f"unknown sample(s) {', '.join(unknown)}; choose from {', '.join(SAMPLES)}")
    for name in names:
        t0 = time.monotonic()
        SAMPLES[name]()
        print(f"  ({name}: {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
