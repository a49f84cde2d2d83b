"""Run ``python -m ferrosync.train`` as a real process, as a user would, and read what
it reports (the FINAL line, the metrics file)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
#: required keys of every metrics line (docs/design.md#metrics-lines)
METRIC_KEYS = {"step", "epoch", "loss", "lr", "compute_s", "sync_s", "bytes", "requests"}


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    # FERROSYNC_JOB too: the launcher names each launch's job, as it does for a user
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FERROSYNC_URL", "SLURM_PROCID",
                 "SLURM_NTASKS", "FERROSYNC_JOB"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS])
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def command(*args) -> list[str]:
    return [sys.executable, "-m", "ferrosync.train", *map(str, args)]


def run_cli(*args, cwd, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    """Run to completion (a test never hangs: ``timeout`` raises)."""
    return subprocess.run(command(*args), cwd=cwd, env=cli_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def run_main(args, cwd, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m ferrosync.train ARGS`` run as a call
    to its ``main`` in this process: for input the launcher refuses before any rank
    starts, where a process would only pay torch's import again. The environment is
    ``cli_env``'s (monkeypatched back afterwards); stdout and stderr through capsys."""
    from ferrosync.train.__main__ import main

    monkeypatch.chdir(cwd)
    for name in set(os.environ) - set(cli_env()):
        monkeypatch.delenv(name)
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # what argparse does on its own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def start_cli(*args, cwd, **env) -> subprocess.Popen:
    """Start without waiting; the tests send it SIGINT (Ctrl-C) and SIGTERM."""
    return subprocess.Popen(command(*args), cwd=cwd, env=cli_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)


def _default_sigint() -> None:
    # a suite started in the background by a non-interactive shell (`cmd &`) inherits
    # SIGINT ignored, and Python then never turns Ctrl-C into KeyboardInterrupt: the
    # launcher under test must see the signal the way a terminal user's would
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def final_of(stdout: str) -> dict:
    """The FINAL record, which must be the last line of stdout."""
    last = stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("FINAL "), f"last stdout line is not FINAL: {last!r}"
    return json.loads(last[len("FINAL "):])


def read_metrics(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def read_metrics_so_far(path) -> list[dict]:
    """The complete lines of a metrics file a running job is still writing: none before
    the file exists, and nothing from the line being written."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    break  # the line being written
    except FileNotFoundError:
        pass
    return rows
