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
    """Run to completion (a test never hangs: ``timeout`` raises, and pytest-timeout
    stops a launcher run in this process). With ``--nproc`` the launcher runs in this
    process (``launch_in_process``) and starts its ranks as real processes."""
    argv = [str(a) for a in args]
    if "--nproc" in argv:
        code, out, err = launch_in_process(argv, cwd, cli_env(**env))
        return subprocess.CompletedProcess(command(*argv), code, out, err)
    return subprocess.run(command(*args), cwd=cwd, env=cli_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def launch_in_process(argv: list[str], cwd, env: dict, *,
                      merged: bool = False) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m ferrosync.train ARGV`` (a launch:
    ``--nproc``), its launcher run as a call to ``main`` in this process with ``env``
    as the environment and ``cwd`` as the directory, both restored afterwards. The
    ranks are the real processes the launcher starts, as for a user; what is saved
    is the launcher's own interpreter and torch import (about 3 CPU-seconds a launch,
    over a hundred launches in the suite). Warnings print, as in a process of its
    own, instead of failing (the suite's filterwarnings=error). ``merged``: stderr
    into stdout, interleaved as written (the third value is then empty)."""
    import contextlib
    import io
    import warnings
    from unittest import mock

    from ferrosync.train.__main__ import main

    assert "--nproc" in argv, "only a launch runs in this process (a rank would run here)"
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="replace", write_through=True)
    err = out if merged else io.TextIOWrapper(err_bytes, encoding="utf-8", errors="replace",
                                              write_through=True)
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    # the launcher imports the model and data factories the ranks will (its checks):
    # from $PYTHONPATH, as a process would, and forgotten afterwards (another test's
    # directory may hold a module of the same name)
    added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and p not in sys.path]
    saved_modules = set(sys.modules)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        # The one sys.path change in tests/, tools/ and examples/: what $PYTHONPATH
        # gives a new interpreter, given to this in-process launcher (a new list, put
        # back afterwards with whatever the launcher added to it)
        with mock.patch.object(sys, "path", added + sys.path), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.simplefilter("default")
            try:
                code = main(list(argv))
            except SystemExit as exc:  # what argparse does on its own errors
                code = exc.code
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for name in set(sys.modules) - saved_modules:
            where = getattr(sys.modules[name], "__file__", None) or ""
            if any(where.startswith(os.path.join(p, "")) for p in added):
                del sys.modules[name]
    out.flush()
    err.flush()
    return (code, out_bytes.getvalue().decode("utf-8", "replace"),
            err_bytes.getvalue().decode("utf-8", "replace"))


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
