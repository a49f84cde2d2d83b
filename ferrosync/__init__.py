"""ferrosync: average gradients across ranks through shared storage.

    import ferrosync
    sync = ferrosync.connect("s3://bucket/runs/exp7")   # or a directory, gloo://, nccl://
    ...
    loss.backward()
    sync.average_gradients(model)

Importing this package is cheap: storage drivers and CUDA load on first use.
"""

from __future__ import annotations

import importlib

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

#: the types users receive and the extension point, by the module that defines them
#: (``"module"``, or ``"module:name"`` where the name there differs)
_LAZY = {
    "Trainer": "ferrosync.train.trainer",
    "ElasticSync": "ferrosync.elastic",
    "PublishedState": "ferrosync.elastic",
    "Strategy": "ferrosync.strategies",
    "GradAveraging": "ferrosync.strategies",
    "LocalSGD": "ferrosync.strategies",
    "DiLoCo": "ferrosync.strategies",
    "StreamingDiLoCo": "ferrosync.strategies",
    "make_strategy": "ferrosync.strategies",
    "wrap": "ferrosync.ddp.comm_hook",
    "register_backend": "ferrosync.core.registry:register",
    "Registration": "ferrosync.core.registry",
}

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
    *_LAZY,
]


def __getattr__(name: str):
    # lazy: the trainer, the elastic layer, the strategies and the DDP hook load only
    # when someone uses them (``import ferrosync`` stays cheap)
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module 'ferrosync' has no attribute {name!r}")
    module, _, attr = home.partition(":")
    return getattr(importlib.import_module(module), attr or name)
