"""Rank discovery: explicit arguments > torchrun > SLURM > a single process."""

from __future__ import annotations

import pytest

from ferrosync.core.env import discover
from ferrosync.errors import ConfigError


@pytest.mark.unit
def test_default_is_a_single_process():
    ident = discover(env={})
    assert (ident.rank, ident.world_size, ident.local_rank, ident.source) == (0, 1, 0, "default")


@pytest.mark.unit
def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    ident = discover(env=env)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (3, 8, 1, 4)
    assert ident.source == "torchrun"


@pytest.mark.unit
def test_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "2(x3)"}
    ident = discover(env=env)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (5, 6, 1, 2)
    assert ident.source == "slurm"


@pytest.mark.unit
def test_torchrun_wins_over_slurm_and_arguments_win_over_both():
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "9"}
    assert discover(env=env).rank == 1
    assert discover(0, 4, env=env).rank == 0
    assert discover(0, 4, env=env).world_size == 4
    assert discover(rank=0, env=env).world_size == 2  # the missing half from the environment


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "1"}, "WORLD_SIZE"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank must be in [0, 2)"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world_size must be >= 1"),
])
def test_bad_environment(env, needle):
    with pytest.raises(ConfigError) as info:
        discover(env=env)
    assert needle in str(info.value)
