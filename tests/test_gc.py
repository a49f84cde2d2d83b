"""``ferrosync gc`` is conservative: what it cannot read, parse or verify protects.

A generation goes only when gc can prove it is not its job's newest announced one and
not live. Junk at a rendezvous record or an abort marker (garbage, a deeply nested
record, a sparse file larger than any record) proves nothing, so it never unprotects a
generation: a job the scheduler suspended (SIGSTOP: no heartbeat moves) survives gc and
finishes correctly once resumed. Real rank processes and the real CLI throughout.
"""

from __future__ import annotations

import os
import signal

import pytest
from test_ops import FAST, NS, WATCH, generation_dirs, start_live, tool_json, w_steps

from ranks import collect, run_ranks

JUNK = ["garbage", "nested", "sparse"]


def plant_junk(path: str, what: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        if what == "garbage":
            f.write(b"\x00not a record\xff")
        elif what == "nested":
            f.write(b"[" * 500_000)
        else:
            f.truncate(1 << 40)  # sparse: larger than any record, costs no disk


@pytest.mark.parametrize("what", JUNK)
def test_gc_never_removes_a_suspended_job_after_a_junk_announcement(tmp_path, capsys, what):
    url = str(tmp_path / "run")
    procs, q, stop = start_live(tmp_path, url)
    (live_dir,) = generation_dirs(url)
    for p in procs.values():
        os.kill(p.pid, signal.SIGSTOP)  # the scheduler suspends the job
    try:
        plant_junk(os.path.join(url, NS, "gen.99"), what)
        done = tool_json(capsys, "gc", url, "--watch", WATCH)
        decision = {d["target"]: d for d in done["decisions"]}[live_dir]
        assert decision["action"] == "keep", decision
        assert "newest generation of job tests" in decision["reason"], decision
        assert live_dir in generation_dirs(url)
    finally:
        for p in procs.values():
            os.kill(p.pid, signal.SIGCONT)
    open(stop, "w").close()
    out = collect(procs, q, timeout=60)
    assert all(isinstance(v, int) and v > 0 for v in out.values()), out  # resumed, finished


@pytest.mark.parametrize("what", JUNK)
def test_gc_keeps_a_dead_generation_whose_abort_marker_is_junk(tmp_path, capsys, what):
    """An older dead generation would go, but an abort marker gc cannot read says
    nothing about whether it finished: it stays (and says why)."""
    url = str(tmp_path / "run")
    procs, q, _stop = start_live(tmp_path, url)
    for p in procs.values():
        os.kill(p.pid, signal.SIGKILL)
    collect(procs, q, timeout=30)
    (dead_dir,) = generation_dirs(url)
    assert run_ranks(w_steps, 2, url, FAST, 1, str(tmp_path / "done")) == [1, 1]
    plant_junk(os.path.join(url, dead_dir, "abort.r1"), what)
    done = tool_json(capsys, "gc", url, "--watch", WATCH)
    decisions = {d["target"]: d for d in done["decisions"]}
    assert decisions[dead_dir]["action"] == "keep", decisions[dead_dir]
    assert "cannot prove" in decisions[dead_dir]["reason"]
    assert dead_dir in generation_dirs(url)
    # without the junk the same generation is provably dead and goes
    os.unlink(os.path.join(url, dead_dir, "abort.r1"))
    done = tool_json(capsys, "gc", url, "--watch", WATCH)
    assert {d["target"]: d["action"] for d in done["decisions"]}[dead_dir] == "remove"
    assert dead_dir not in generation_dirs(url)
