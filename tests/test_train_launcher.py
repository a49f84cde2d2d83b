"""``python -m ferrosync.train`` as users run it: real launcher, real rank processes.

The launcher is started as a subprocess exactly as from a shell; the tests read its
exit code, its output and the files it writes, and kill its ranks with real signals.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import threading
import time

import pytest
from train_cli import (
    METRIC_KEYS,
    await_point,
    final_of,
    read_metrics,
    reaped,
    run_cli,
    start_cli,
)

from ferrosync.train.metrics import FINAL_KEYS


@pytest.mark.parametrize("nproc", [2, 3])
def test_demo_trains_and_ranks_agree(tmp_path, nproc):
    metrics = tmp_path / "metrics.jsonl"
    proc = run_cli("--nproc", nproc, "--steps", 40, "--metrics", metrics, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr

    final = final_of(proc.stdout)
    assert set(FINAL_KEYS) <= set(final)
    assert final["steps"] == 40 and final["world_size"] == nproc
    assert final["ranks_agree"] is True
    assert set(final["rank_digests"]) == {final["param_digest"]}
    assert 0.0 <= final["accuracy"] <= 1.0
    assert final["loss"] > 0 and final["bytes_written"] > 0 and final["bytes_read"] > 0
    assert final["requests"] > 0
    # the summary table came from rank 0, prefixed; the temporary sync dir is gone
    assert "[rank 0] ferrosync.train summary" in proc.stdout
    url = re.search(r"sync URL (\S+)", proc.stderr).group(1)
    assert not os.path.exists(url)

    lines = read_metrics(metrics)
    assert [m["step"] for m in lines] == list(range(1, 41))
    for m in lines:
        assert METRIC_KEYS <= set(m)
        assert m["bytes"] > 0 and m["requests"] > 0 and m["sync_s"] >= 0 and m["lr"] == 0.05
    # per-step bytes, not a running total: about the same every step
    assert max(m["bytes"] for m in lines) < 3 * min(m["bytes"] for m in lines)


def _pids(stderr_lines: list[str], nproc: int, deadline: float) -> dict[int, int]:
    while time.monotonic() < deadline:
        for line in list(stderr_lines):
            found = dict((int(r), int(p)) for r, p in re.findall(r"rank (\d+) pid (\d+)", line))
            if len(found) == nproc:
                return found
        time.sleep(0.02)
    raise AssertionError(f"the launcher never announced its ranks: {stderr_lines}")


def _collect(stream, into: list[str]) -> threading.Thread:
    def run():
        for line in stream:
            into.append(line)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie waiting to be reaped by init counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except OSError:
        return True


@pytest.mark.timing
def test_killing_one_rank_stops_the_others(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # paced (50 ms a step): it runs until killed without taking the cores meanwhile
    # ranks as new interpreters, started by the launcher's own Popen: the real thing
    proc = start_cli("--nproc", 3, "--steps", 1_000_000, "--metrics", metrics,
                     "--model", "train_models:paced_mlp", cwd=tmp_path, fork_ranks=False,
                     FERROSYNC_TEST_STEP_S=0.05)
    err: list[str] = []
    readers = [_collect(proc.stderr, err), _collect(proc.stdout, [])]
    try:
        pids = _pids(err, 3, time.monotonic() + 60)
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline, "training never started"
            assert proc.poll() is None, "".join(err)
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    for reader in readers:
        reader.join(timeout=10)
    proc.stdout.close()
    proc.stderr.close()
    text = "".join(err)
    assert code != 0
    assert took < 30, f"the launcher needed {took:.1f} s to stop"
    assert "rank 1 was killed by SIGKILL" in text
    assert "stopped ranks [0, 2]" in text
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in pids.values()):
        assert time.monotonic() < deadline, f"ranks still running: {pids}"
        time.sleep(0.05)


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import ferrosync

    with ferrosync.connect() as sync:          # everything from the environment
        x = torch.full((4,), float(sync.rank + 1))
        sync.average_(x)
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FERROSYNC_URL")}
        print(json.dumps({"rank": sync.rank, "avg": x.tolist(), "argv": sys.argv[1:],
                          "env": env}))
        if "--fail" in sys.argv and sync.rank == 1:
            raise RuntimeError("boom on rank 1")
        if "--bad-option" in sys.argv:
            ferrosync.connect(wire_dtype="int3")
        sync.barrier()
""")


def _script(tmp_path):
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT)
    return path


def test_user_script_runs_on_every_rank(tmp_path):
    import json

    proc = run_cli("--nproc", 3, _script(tmp_path), "--lr", "7", "x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = {}
    for line in proc.stdout.splitlines():
        prefix, _, body = line.partition("] ")
        record = json.loads(body)
        assert prefix == f"[rank {record['rank']}"
        records[record["rank"]] = record
    assert sorted(records) == [0, 1, 2]
    (url,) = {r["env"].pop("FERROSYNC_URL") for r in records.values()}
    assert re.search(rf"sync URL {re.escape(url)}", proc.stderr)
    for rank, r in records.items():
        assert r["avg"] == [2.0] * 4  # (1 + 2 + 3) / 3
        assert r["argv"] == ["--lr", "7", "x"]  # flags after SCRIPT belong to it
        assert r["env"] == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank)}


@pytest.mark.parametrize("flag, code, needle", [
    ("--fail", 1, "rank 1 failed with exit code 1: RuntimeError: boom on rank 1"),
    ("--bad-option", 2, "wire_dtype"),
])
def test_user_script_failure_stops_the_job(tmp_path, flag, code, needle):
    proc = run_cli("--nproc", 2, _script(tmp_path), flag, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert needle in proc.stderr


def test_a_second_sigterm_while_stopping_exits_like_the_first(tmp_path):
    """Two SIGTERMs (a supervisor repeating itself): 143 and one line, as for one. The
    second arrives while the launcher waits for a rank that outlives its SIGTERM (it
    announces the signal), i.e. in the middle of the stop."""
    marker = tmp_path / "paused.r1"
    proc = start_cli("--nproc", 2, "--model", "train_models:dropout_mlp", "--steps", 50,
                     "--no-progress", cwd=tmp_path, FERROSYNC_TEST_PAUSE_AT=3,
                     FERROSYNC_TEST_PAUSE_RANK=1, FERROSYNC_TEST_PAUSE_DIR=tmp_path,
                     FERROSYNC_TEST_PAUSE_HOLD_TERM=1)
    with reaped(proc):
        await_point(proc, marker.exists, "step 3 of rank 1")
        proc.send_signal(signal.SIGTERM)
        # the launcher has begun stopping the ranks: rank 1 announces its SIGTERM
        await_point(proc, (tmp_path / "paused.r1.term").exists, "the stop of rank 1")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated: stopped every rank" in err
    assert "_Stop" not in err and "Traceback" not in err and "error:" not in err, err
