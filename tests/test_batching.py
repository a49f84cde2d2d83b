"""Whole-batch gathering for TensorDatasets (``ferrosync.train.batching``) gives the
batches the per-sample DataLoader path gives, bit for bit, and trains the same model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

import ferrosync
from ferrosync.partition import ShardSampler
from ferrosync.train.batching import batch_loader, batch_of, gathers_batches


class PerSample(TensorDataset):
    """A TensorDataset whose own ``__getitem__`` must be called once per sample (as a
    subclass that augments would need)."""

    calls = 0

    def __getitem__(self, index):
        PerSample.calls += 1
        return super().__getitem__(index)


def _data(n=203):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(n, 5, generator=g), torch.randint(0, 4, (n,), generator=g),
            torch.randn(n, 2, 3, generator=g).to(torch.float64))


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert torch.equal(u, v)


@pytest.mark.unit
def test_only_plain_tensor_datasets_gather_whole_batches():
    tensors = _data()
    assert gathers_batches(TensorDataset(*tensors))
    assert not gathers_batches(PerSample(*tensors))
    assert not gathers_batches(list(zip(*tensors)))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_batches_equal_the_per_sample_path(num_workers):
    tensors = _data()
    fast = TensorDataset(*tensors)
    for rank in range(3):
        # a short last batch (68 samples per rank, batch 16), a mid-epoch resume
        sampler = ShardSampler(len(fast), rank=rank, world_size=3, seed=5)
        reference = list(DataLoader(fast, batch_size=16, sampler=sampler))
        got = list(batch_loader(fast, sampler, 16, num_workers=num_workers))
        _assert_same(got, reference)
        assert len(got[-1][0]) == 68 % 16
        sampler.set_epoch(2)
        sampler.load_state_dict(sampler.state_dict(32) | {"epoch": 2})
        reference = list(DataLoader(fast, batch_size=16, sampler=sampler))
        sampler.load_state_dict(sampler.state_dict(32) | {"epoch": 2})
        _assert_same(list(batch_loader(fast, sampler, 16)), reference)


@pytest.mark.unit
def test_a_subclass_with_its_own_getitem_keeps_the_per_sample_path():
    slow = PerSample(*_data())
    PerSample.calls = 0
    sampler = ShardSampler(len(slow), rank=0, world_size=1, seed=1)
    batches = list(batch_loader(slow, sampler, 50))
    assert PerSample.calls == len(slow)  # its __getitem__ saw every sample
    _assert_same(batches, list(DataLoader(TensorDataset(*_data()), batch_size=50,
                                          sampler=sampler)))


@pytest.mark.unit
def test_batch_of_equals_default_collate():
    tensors = _data()
    index = torch.randperm(len(tensors[0]), generator=torch.Generator().manual_seed(0))[:37]
    for dataset in (TensorDataset(*tensors), PerSample(*tensors)):
        expected = default_collate([dataset[int(i)] for i in index])
        _assert_same([batch_of(dataset, index)], [expected])
        _assert_same([batch_of(dataset, index.tolist())], [expected])


def _train(dataset, url):
    torch.manual_seed(0)
    trainer = ferrosync.Trainer(
        lambda: torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.2),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 4)),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.nn.functional.cross_entropy,
        dataset, batch_size=16, epochs=2, progress=False, report=False, rank=0, world_size=1)
    with ferrosync.connect(url, rank=0, world_size=1, timeout=30) as sync:
        summary = trainer.fit(sync)
    return summary["param_digest"]


@pytest.mark.unit
def test_the_trainer_trains_the_same_model_either_way(tmp_path):
    x, y, _ = _data()
    fast = _train(TensorDataset(x, y), str(tmp_path / "a"))
    slow = _train(PerSample(x, y), str(tmp_path / "b"))
    assert fast == slow
