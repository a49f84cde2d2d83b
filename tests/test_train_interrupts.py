"""Ctrl-C and a reused checkpoint directory, as a user meets them: real interpreters.

``python -m ferrosync.train`` spends its first seconds importing torch. A Ctrl-C then
must end it with one line and exit 130: no traceback of the import machinery, no
half-loaded extension ("cannot load module more than once per process"), never a lost
signal (a job that runs on). These tests start new interpreters (the suite's forked
ones have torch loaded already) and interrupt them at points read from the process
itself (``/proc/PID/maps``: torch's library being loaded), not after guessed delays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from train_cli import await_point, cli_env, command, reaped, start_cli


def _mapped(pid: int, library: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return library in f.read()
    except FileNotFoundError:
        return False


def _as_from_a_terminal() -> None:
    # runs in the child before exec: Ctrl-C's disposition as a terminal's shell gives it
    # (a test worker may have inherited or been left with SIGINT ignored, and an ignored
    # SIGINT is rightly left ignored by the command: nohup's meaning)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_when(tmp_path, ready, *args, argv=None) -> subprocess.CompletedProcess:
    """Start a real ``python -m ferrosync.train ARGS`` (or ``argv``), send SIGINT once
    ``ready(pid)``."""
    proc = subprocess.Popen(argv or command(*args), cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal)
    with reaped(proc):
        await_point(proc, lambda: ready(proc.pid), "the start-up point")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/PID/maps")
@pytest.mark.parametrize("library", ["_multiarray_umath", "libtorch_cpu", "libtorch_python"])
def test_ctrl_c_while_torch_imports_is_one_line_and_130(tmp_path, library):
    """Interrupted once NumPy's, torch's core or torch's Python library is mapped: three
    points across the import (numpy first, then torch's core, then torch._C)."""
    # a signal lost would let this run train for minutes: communicate's timeout fails it
    done = _interrupt_when(tmp_path, lambda pid: _mapped(pid, library), "--nproc", 1,
                           "--steps", 1_000_000, "--no-progress")
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == ["ferrosync.train: interrupted"], done.stderr
    assert "FINAL" not in done.stdout


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/PID/maps")
def test_ctrl_c_while_an_operator_tool_imports_torch(tmp_path):
    done = _interrupt_when(tmp_path, lambda pid: _mapped(pid, "libtorch_cpu"),
                           argv=[sys.executable, "-m", "ferrosync", "inspect", tmp_path])
    assert done.returncode == 130, done.stderr
    assert done.stderr == "ferrosync: interrupted\n" and done.stdout == ""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/PID/maps")
def test_ctrl_c_while_the_local_s3_server_command_imports_torch(tmp_path):
    """``python -m ferrosync.testing.seaweed`` imports ferrosync (and torch) first."""
    done = _interrupt_when(tmp_path, lambda pid: _mapped(pid, "libtorch_cpu"),
                           argv=[sys.executable, "-m", "ferrosync.testing.seaweed",
                                 "--dir", tmp_path / "data"])
    assert done.returncode == 130, done.stderr
    assert done.stderr == "ferrosync.testing.seaweed: interrupted\n" and done.stdout == ""
    assert not (tmp_path / "data").exists()  # nothing started, nothing made


def test_ctrl_c_names_the_checkpoint_to_resume_from(tmp_path):
    """A rank started by hand (no launcher) with checkpoints: Ctrl-C says where the run
    can continue from, on its one line."""
    ck, marker = tmp_path / "ck", tmp_path / "paused.r0"
    proc = start_cli("--sync", tmp_path / "sync", "--model", "train_models:dropout_mlp",
                     "--steps", 50, "--checkpoint-dir", ck, "--checkpoint-every", 2,
                     "--no-progress", cwd=tmp_path, FERROSYNC_TEST_PAUSE_AT=5,
                     FERROSYNC_TEST_PAUSE_RANK=0, FERROSYNC_TEST_PAUSE_DIR=tmp_path)
    with reaped(proc):
        # inside step 5: the checkpoint of step 4 is written
        await_point(proc, marker.exists, "step 5 of the rank")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [(
        f"ferrosync.train: interrupted; the latest checkpoint is step 4 in {ck}: run the "
        "same command with --resume to continue from it")], err
