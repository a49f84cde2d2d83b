"""Torch's thread pool of a ``python -m ferrosync.train`` started by hand: its share of
the host's cores when several share the host (counted through a host-local registry of
real processes), untouched when ``OMP_NUM_THREADS`` is set. Wall-time effects are
measured by tools/bench/bench_threads.py, not here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from train_cli import cli_env, command

from ferrosync.train.threads import ThreadShare, host_cores, registry_dir

HOLD = textwrap.dedent("""
    import sys
    from ferrosync.train.threads import ThreadShare
    share = ThreadShare(sys.argv[1] if len(sys.argv) > 1 else None)
    assert share.register()
    print("ready", flush=True)
    sys.stdin.read()          # held until the test closes our stdin
""")


def _holder(directory=None) -> subprocess.Popen:
    """A real process registered in the registry until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, *([str(directory)] if directory else [])],
                            env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)
    proc.stdout.close()


def test_registry_counts_live_processes_and_drops_the_dead(tmp_path):
    share = ThreadShare(str(tmp_path / "procs"), cores=4)
    assert share.register() and share.count() == 1
    other = _holder(tmp_path / "procs")
    assert share.count() == 2
    before = torch.get_num_threads()
    try:
        share._next = 0.0
        assert share.adjust() == 2 and torch.get_num_threads() == 2  # 4 cores / 2
        _release(other)
        share._next = 0.0
        assert share.count() == 1
        assert sorted(os.listdir(tmp_path / "procs")) == [share.name]  # the dead one's gone
        share._next = 0.0
        assert share.adjust() == 4  # alone again: every core
    finally:
        torch.set_num_threads(before)
        share.unregister()
    # a file naming a live pid with another start time is a reused pid: not counted
    (tmp_path / "procs" / f"{os.getpid()}.1").touch()
    (tmp_path / "procs" / "999999999.5").touch()  # no such process
    fresh = ThreadShare(str(tmp_path / "procs"), cores=4)
    assert fresh.register() and fresh.count() == 1
    fresh.unregister()


SCRIPT = textwrap.dedent("""
    import torch
    print("THREADS", torch.get_num_threads(), flush=True)
""")


def _threads_of_hand_started(tmp_path, omp: str | None) -> int:
    """``python -m ferrosync.train --sync DIR SCRIPT`` as one rank (RANK/WORLD_SIZE as
    another launcher sets them), ``OMP_NUM_THREADS`` unset when ``omp`` is None."""
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    env = cli_env(RANK=0, WORLD_SIZE=1)
    env.pop("OMP_NUM_THREADS")
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    proc = subprocess.run(command("--sync", tmp_path / "sync", script), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split("THREADS")[1].split()[0])


def test_a_rank_started_by_hand_takes_its_share_of_the_cores(tmp_path):
    other = _holder()  # another hand-started process on this host (the real registry)
    try:
        assert _threads_of_hand_started(tmp_path, None) <= max(1, host_cores() // 2)
        # the user's choice wins (torch's pool is at most the cores: ask for all of them)
        cores = host_cores()
        assert _threads_of_hand_started(tmp_path, str(cores)) == cores
    finally:
        _release(other)
    assert os.path.isdir(registry_dir())


def test_connect_in_a_users_script_leaves_threads_alone(tmp_path):
    code = textwrap.dedent(f"""
        import torch, ferrosync
        before = torch.get_num_threads()
        with ferrosync.connect({str(tmp_path / "s")!r}, rank=0, world_size=1, job="t") as s:
            s.average_([torch.ones(3)])
        print(before, torch.get_num_threads())
    """)
    other = _holder()
    try:
        env = cli_env()
        env.pop("OMP_NUM_THREADS")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        _release(other)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert before == after
