"""Batches of an in-memory dataset in one indexing operation per tensor.

Where the dataset is a plain ``TensorDataset`` the trainer hands the loader whole batches
of indices (``BatchSampler``) and the dataset gathers them at once: the same tensors,
bit for bit, in about a tenth of ``default_collate``'s time (docs/goodput.md). Any
other dataset keeps the per-sample path; which samples a batch holds never changes.
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset, default_collate

__all__ = ["gathers_batches", "batch_of", "batch_loader"]


def gathers_batches(dataset) -> bool:
    """Whether ``dataset[list_of_indices]`` is already the collated batch: a
    ``TensorDataset`` whose ``__getitem__`` is ``TensorDataset``'s own (a subclass
    that overrides it, e.g. to augment per sample, keeps the per-sample path)."""
    return (isinstance(dataset, TensorDataset)
            and type(dataset).__getitem__ is TensorDataset.__getitem__)


def batch_of(dataset, indices) -> list:
    """The batch of ``dataset`` at ``indices`` (a sequence or 1-D tensor of ints), as
    ``default_collate`` of the samples would give it: a list of tensors, one per
    field."""
    if gathers_batches(dataset):
        index = torch.as_tensor(indices, dtype=torch.long)
        return [t[index] for t in dataset.tensors]
    return default_collate([dataset[int(i)] for i in indices])


def batch_loader(dataset, sampler: Sampler, batch_size: int, *, num_workers: int = 0,
                 generator: torch.Generator | None = None) -> DataLoader:
    """A ``DataLoader`` over ``sampler``'s indices in batches of ``batch_size`` (the
    last one may be shorter), gathering whole batches where ``gathers_batches``."""
    if gathers_batches(dataset):
        # batch_size=None: each sampler item (a list of indices) is one fetch,
        # dataset[list] -> tuple of batched tensors, passed through unchanged
        return DataLoader(dataset, batch_size=None,
                          sampler=BatchSampler(sampler, batch_size, drop_last=False),
                          num_workers=num_workers, generator=generator)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      num_workers=num_workers, generator=generator)
