"""Smaller first-contact cases: a rank without a world size, an interrupted rank's
peers, ``inspect`` with hostile names."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import ferrosync
from ferrosync.errors import ConfigError, PeerFailed
from ranks import RankFailure, collect, start_ranks, wait_until


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.unit
def test_a_rank_without_any_world_size_is_refused(tmp_path, monkeypatch, rank):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    url = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"rank={rank} given, but no world size") as info:
        ferrosync.connect(url, rank=rank)
    assert "WORLD_SIZE" in str(info.value) and "world_size=" in str(info.value)
    assert not os.path.exists(url)  # before any I/O
    # from the environment it is fine
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    if rank == 0:
        ferrosync.connect(url, rank=0).close()


def w_interrupted(rank, world, url):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a user's script
    sync = ferrosync.connect(url, rank=rank, world_size=world, timeout=30,
                             heartbeat_interval=0.2, heartbeat_timeout=5.0)
    try:
        x = torch.ones(4)
        sync.average_(x)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C between steps
            wait_until(lambda: False, "the interrupt", timeout=10)
        sync.average_(x)
    finally:
        sync.close()


def test_an_interrupted_ranks_peers_read_that_it_was_interrupted(tmp_path):
    procs, results = start_ranks(w_interrupted, 2, str(tmp_path / "run"))
    out = collect(procs, results, timeout=60)
    assert isinstance(out[1], RankFailure) and isinstance(out[1].error, KeyboardInterrupt)
    err = out[0].error
    assert isinstance(err, PeerFailed), out
    assert "rank 1 failed" in str(err) and "interrupted (SIGINT or Ctrl-C)" in str(err), err
    assert "fewer steps" not in str(err)


@pytest.mark.unit
def test_inspect_and_gc_escape_hostile_names(tmp_path, capsys):
    """Names and record fields come from storage: a newline cannot forge a report line,
    a right-to-left override cannot reverse one."""
    from ferrosync.__main__ import main

    run = tmp_path / "run"
    run.mkdir()
    hostile = ["evil\nABORT rank 0: forged line", "txt.\u202egpj.exe", "tab\there"]
    for name in hostile:
        (run / name).write_bytes(b"x")
    for tool in ("inspect", "gc"):
        capsys.readouterr()
        assert main([tool, str(run), "--watch", "0"] + (["--dry-run"] if tool == "gc"
                                                        else [])) == 0
        out = capsys.readouterr().out
        assert "\u202e" not in out and "\t" not in out, out
        assert "\nABORT rank 0: forged line" not in out, out
        if tool == "inspect":
            assert "evil\\nABORT rank 0: forged line" in out, out
            assert "txt.\\u202egpj.exe" in out and "tab\\there" in out, out
