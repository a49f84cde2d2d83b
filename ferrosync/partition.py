"""Deterministic, equal-sized data partitions: ``shard_indices`` and ``ShardSampler``.

Every rank gets the same number of indices (padded by wrapping, or the tail dropped), so
no rank runs an extra step and deadlocks the others; the order is
``DistributedSampler``'s for the same ``(seed, epoch)`` (a ``torch.randperm`` seeded with
``seed + epoch``, dealt round-robin), so either sampler gives the same batches
(docs/design.md#gradsync-collectives).
"""

from __future__ import annotations

from typing import Iterator, Sized

import torch

from ferrosync.core.validate import integer

__all__ = ["shard_indices", "ShardSampler"]


def shard_indices(
    n: int,
    rank: int,
    world_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> list[int]:
    """Indices of ``range(n)`` that ``rank`` processes in ``epoch``.

    Guarantees, for every rank of the same ``(n, world_size, shuffle, seed, epoch,
    drop_last)``:

    * every rank gets the same count: ``ceil(n/W)``, or ``floor(n/W)`` with drop_last;
    * without drop_last the ranks' union is ``range(n)``; the lists are disjoint
      when ``n % W == 0``, and otherwise the first ``W*ceil(n/W) - n`` indices of
      the (possibly shuffled) order are repeated once to fill the last round;
    * the result depends only on the arguments (not on process, host or time);
    * with ``shuffle``, different epochs give different orders.

    Example: ``shard_indices(8, 0, 2) == [0, 2, 4, 6]`` and
    ``shard_indices(8, 1, 2) == [1, 3, 5, 7]``.
    """
    integer("n", n, minimum=0)
    integer("world_size", world_size, minimum=1)
    integer("epoch", epoch, minimum=0)
    integer("rank", rank, minimum=0, maximum=world_size - 1)
    integer("seed", seed)

    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=generator).tolist()
    else:
        order = list(range(n))

    if drop_last:
        total = (n // world_size) * world_size
        order = order[:total]
    else:
        per_rank = -(-n // world_size)
        total = per_rank * world_size
        if n and total > n:
            # wrap around (repeatedly, when world_size > n) so every rank has work
            repeats = -(-total // n)
            order = (order * repeats)[:total]
    return order[rank:total:world_size]


class ShardSampler(torch.utils.data.Sampler):
    """A ``Sampler`` yielding this rank's ``shard_indices`` for the current epoch.

    Args:
        dataset_or_len: a sized dataset, or its length.
        rank, world_size: from the environment (``ferrosync.core.env.discover``) when None.
        shuffle, seed, drop_last: as in ``shard_indices``.

    Call ``set_epoch(e)`` at the start of each epoch on every rank (the same ``e``),
    or every epoch repeats the same order. ``state_dict()``/``load_state_dict()``
    carry the epoch and the position within it, so a resumed run continues with
    the exact next batch.
    """

    def __init__(
        self,
        dataset_or_len: int | Sized,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        from ferrosync.core.env import discover

        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        identity = discover(rank, world_size)
        self.n = n
        self.rank = identity.rank
        self.world_size = identity.world_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._skip = 0  # indices already consumed in this epoch (after a resume)
        # validate the arguments now rather than at the first iteration
        shard_indices(self.n, self.rank, self.world_size, seed=seed, drop_last=drop_last)

    def set_epoch(self, epoch: int) -> None:
        integer("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = epoch

    def indices(self) -> list[int]:
        return shard_indices(
            self.n,
            self.rank,
            self.world_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        return iter(self.indices()[skip:])

    def __len__(self) -> int:
        per_rank = self.n // self.world_size if self.drop_last else -(-self.n // self.world_size)
        return per_rank

    def state_dict(self, consumed: int = 0) -> dict:
        """Plain ints only (checkpoint-safe): epoch and indices consumed this epoch."""
        return {"epoch": self.epoch, "consumed": int(consumed), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self._skip = int(state.get("consumed", 0))
