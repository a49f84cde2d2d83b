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
