"""ferrosync: average gradients across ranks through shared storage.

    import ferrosync
    sync = ferrosync.connect("s3://bucket/runs/exp7")   # or a directory, gloo://, nccl://
    ...
    loss.backward()
    sync.average_gradients(model)

Importing this package is cheap: storage drivers and CUDA load on first use.
"""

from __future__ import annotations

from ferrosync.core import interrupts

interrupts.hold_at_start()  # before torch: a command's Ctrl-C waits for its main (see there)

from ferrosync import ddp, errors  # noqa: E402
from ferrosync.api import GradSync, SyncHandle, connect  # noqa: E402
from ferrosync.errors import (  # noqa: E402
    ConfigError,
    DuplicateRank,
    FerrosyncError,
    JobEnded,
    LayoutMismatch,
    MemberDropped,
    PeerFailed,
    ShardCorrupt,
    StorageError,
    SyncClosed,
    SyncTimeout,
)
from ferrosync.partition import ShardSampler, shard_indices  # noqa: E402

__version__ = "0.1.0"

# torch.distributed backend "ferrosync" and its init_method URLs (cheap: torch only)
ddp.register()

__all__ = [
    "connect",
    "GradSync",
    "SyncHandle",
    "shard_indices",
    "ShardSampler",
    "errors",
    "FerrosyncError",
    "ConfigError",
    "SyncTimeout",
    "PeerFailed",
    "ShardCorrupt",
    "LayoutMismatch",
    "DuplicateRank",
    "StorageError",
    "SyncClosed",
    "JobEnded",
    "MemberDropped",
    "__version__",
    "Trainer",
]


def __getattr__(name: str):
    # lazy: the trainer and its CLI modules load only when someone uses them
    if name == "Trainer":
        from ferrosync.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'ferrosync' has no attribute {name!r}")
