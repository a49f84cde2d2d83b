"""What the operator tools say about a rank stopped by a signal (``inspect``) and about a
location they cannot write to (``doctor``): real processes, real signals, a real
read-only directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from train_cli import cli_env, run_forked, start_cli

from ferrosync.storage.liveness import describe_abort


def _tool(*args, cwd) -> subprocess.CompletedProcess:
    return run_forked([sys.executable, "-m", "ferrosync", *map(str, args)], cwd=cwd,
                      env=cli_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.unit
def test_describe_abort():
    assert describe_abort("SystemExit", "143") == "terminated by SIGTERM"
    assert describe_abort("SystemExit", "137") == "terminated by SIGKILL"
    assert describe_abort("SystemExit", "1") == "SystemExit: 1"
    assert describe_abort("SystemExit", "999") == "SystemExit: 999"  # no such signal
    assert describe_abort("PeerFailed", "rank 1 failed") == "PeerFailed: rank 1 failed"


def test_inspect_names_the_signal_that_stopped_a_rank(tmp_path):
    sync, metrics = tmp_path / "sync", tmp_path / "m.jsonl"
    # paced (50 ms a step): it runs until stopped without taking the cores meanwhile
    proc = start_cli("--nproc", 2, "--steps", 1_000_000, "--sync", sync, "--metrics", metrics,
                     "--no-progress", "--model", "train_models:paced_mlp", cwd=tmp_path,
                     FERROSYNC_TEST_STEP_S=0.05)
    try:
        deadline = time.monotonic() + 120
        line = proc.stderr.readline()  # "started 2 ranks (rank 0 pid A, rank 1 pid B)"
        pids = dict((int(r), int(p)) for r, p in re.findall(r"rank (\d+) pid (\d+)", line))
        assert len(pids) == 2, line
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    report = _tool("inspect", sync, cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert re.search(r"ABORT rank 1( at collective \d+)?: terminated by SIGTERM", report.stdout), \
        report.stdout
    # nor in rank 0's marker, whether it saw rank 1 go (PeerFailed: "rank 1 was
    # terminated by SIGTERM") or was stopped by the launcher first
    assert "SystemExit: 143" not in report.stdout
    as_json = json.loads(_tool("inspect", sync, "--json", cwd=tmp_path).stdout)
    descriptions = [a["description"] for g in as_json["generations"] for a in g["aborts"]
                    if a["rank"] == 1]
    assert descriptions == ["terminated by SIGTERM"], as_json


def test_doctor_reports_a_read_only_location_as_a_failed_check(tmp_path, read_only_dir):
    report = _tool("doctor", read_only_dir, "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr  # the tool ran: what it found is data
    assert "storage failed" not in report.stderr
    checks = {c["name"]: c for c in json.loads(report.stdout)["checks"]}
    assert checks["location"]["status"] == "ok"
    assert checks["writable"]["status"] == "fail"
    assert "cannot create the scratch directory" in checks["writable"]["summary"]
    assert "atomic publish" not in checks  # the write checks were skipped, not failed
    text = _tool("doctor", read_only_dir, cwd=tmp_path)
    assert text.returncode == 0 and re.search(r"\[fail\] writable", text.stdout), text.stdout
    assert _tool("doctor", read_only_dir, "--strict", cwd=tmp_path).returncode == 1
    assert list(read_only_dir.iterdir()) == []
