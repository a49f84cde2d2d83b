"""shard_indices and ShardSampler: equal counts, full coverage, determinism."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from ferrosync import ShardSampler, shard_indices
from ferrosync.errors import ConfigError

pytestmark = pytest.mark.unit

cases = st.tuples(
    st.integers(min_value=0, max_value=300),  # n
    st.integers(min_value=1, max_value=9),  # world size
    st.booleans(),  # shuffle
    st.integers(min_value=0, max_value=2**31),  # seed
    st.integers(min_value=0, max_value=50),  # epoch
    st.booleans(),  # drop_last
)


def all_ranks(n, w, shuffle, seed, epoch, drop_last):
    return [shard_indices(n, r, w, shuffle=shuffle, seed=seed, epoch=epoch,
                          drop_last=drop_last) for r in range(w)]


@settings(max_examples=300, deadline=None)
@given(cases)
def test_invariants(case):
    n, w, shuffle, seed, epoch, drop_last = case
    parts = all_ranks(*case)
    counts = {len(p) for p in parts}
    assert len(counts) == 1, "every rank gets the same count"
    count = counts.pop()
    assert count == (n // w if drop_last else -(-n // w))
    flat = [i for p in parts for i in p]
    assert all(0 <= i < n for i in flat)
    if not drop_last:
        assert set(flat) == set(range(n)), "the union covers every index"
    if n % w == 0 or drop_last:
        assert len(set(flat)) == len(flat), "disjoint when nothing is padded"
    assert parts == all_ranks(*case), "deterministic"


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 200), st.integers(1, 5), st.integers(0, 1000), st.booleans())
def test_matches_torch_distributed_sampler(n, w, seed, drop_last):
    for epoch in (0, 3):
        for r in range(w):
            ref = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=True, seed=seed,
                                     drop_last=drop_last)
            ref.set_epoch(epoch)
            assert list(ref) == shard_indices(n, r, w, shuffle=True, seed=seed, epoch=epoch,
                                              drop_last=drop_last)


def test_round_robin_prototype_result():
    assert shard_indices(8, 0, 2) == [0, 2, 4, 6]
    assert shard_indices(8, 1, 2) == [1, 3, 5, 7]


def test_padding_wraps_around():
    assert [shard_indices(5, r, 3) for r in range(3)] == [[0, 3], [1, 4], [2, 0]]
    # more ranks than items: everyone still gets one
    assert [shard_indices(2, r, 5) for r in range(5)] == [[0], [1], [0], [1], [0]]


def test_shuffle_changes_with_epoch_and_seed():
    a = shard_indices(100, 0, 2, shuffle=True, seed=1, epoch=0)
    assert a != shard_indices(100, 0, 2, shuffle=True, seed=1, epoch=1)
    assert a != shard_indices(100, 0, 2, shuffle=True, seed=2, epoch=0)


@pytest.mark.parametrize("kwargs", [
    {"n": -1, "rank": 0, "world_size": 1},
    {"n": 4, "rank": 2, "world_size": 2},
    {"n": 4, "rank": 0, "world_size": 0},
    {"n": 4, "rank": 0, "world_size": 1, "epoch": -1},
    {"n": 4.0, "rank": 0, "world_size": 1},
])
def test_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        shard_indices(**kwargs)


def test_sampler_epochs_length_and_resume():
    sampler = ShardSampler(range(10), rank=1, world_size=3, shuffle=True, seed=7)
    assert len(sampler) == 4
    sampler.set_epoch(2)
    full = list(sampler)
    assert full == shard_indices(10, 1, 3, shuffle=True, seed=7, epoch=2)
    # resume after consuming 3 indices of epoch 2
    resumed = ShardSampler(10, rank=1, world_size=3, shuffle=True, seed=0)
    resumed.load_state_dict(sampler.state_dict(consumed=3))
    assert list(resumed) == full[3:]
    assert list(resumed) == full  # the skip applies to one pass only


def test_sampler_reads_identity_from_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    sampler = ShardSampler(9, shuffle=False)
    assert list(sampler) == [2, 6, 1]


def test_sampler_with_dataloader():
    data = torch.arange(20).float()
    sampler = ShardSampler(data, rank=0, world_size=2, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    assert torch.cat(list(loader)).tolist() == [float(i) for i in range(0, 20, 2)]
