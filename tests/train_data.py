"""Data factories for the trainer's input checks, importable by ranks as
``--data train_data:...`` (tests/test_train_validation.py)."""

from __future__ import annotations

import atexit
import os
import signal

import numpy
import torch
from torch.utils.data import Dataset, TensorDataset

FEATURES, CLASSES = 10, 4


def _pairs(x: torch.Tensor) -> TensorDataset:
    return TensorDataset(x, (x.sum(dim=1) > 0).long() % CLASSES)


def unseeded_numpy() -> TensorDataset:
    """NumPy's generator from OS entropy: different samples in every process."""
    rng = numpy.random.default_rng()
    return _pairs(torch.from_numpy(rng.standard_normal((512, FEATURES)).astype("float32")))


def length_by_rank() -> TensorDataset:
    """The same generator, but a length that depends on the rank."""
    g = torch.Generator().manual_seed(1)
    n = 512 + 8 * int(os.environ.get("RANK", "0"))
    return _pairs(torch.randn(n, FEATURES, generator=g))


def seeded() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return _pairs(torch.randn(512, FEATURES, generator=g))


class Augmented(Dataset):
    """Fixed samples plus noise drawn from torch's global generator at every read (as
    random augmentation does): the same data on every rank."""

    def __init__(self) -> None:
        self.base = seeded()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.01 * torch.randn(FEATURES), y


def augmented() -> Augmented:
    return Augmented()


def three() -> TensorDataset:
    """3 samples: fewer than 4 ranks."""
    g = torch.Generator().manual_seed(1)
    return _pairs(torch.randn(3, FEATURES, generator=g))


class _FailsOnRank1(torch.nn.Module):
    """The demo's shapes; its forward raises on rank 1 (a bug in the user's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("shape trouble on rank 1")
        return self.lin(x)


def fails_on_rank1() -> torch.nn.Module:
    return _FailsOnRank1()


def sigterm_at_exit() -> torch.nn.Module:
    """The demo's shapes; a rank (not the launcher, which builds the model too) sends
    itself SIGTERM from an atexit callback: a launcher stopping a rank that is already
    exiting, made deterministic."""
    if os.environ.get("RANK") is not None:
        atexit.register(os.kill, os.getpid(), signal.SIGTERM)
    return torch.nn.Linear(FEATURES, CLASSES)
