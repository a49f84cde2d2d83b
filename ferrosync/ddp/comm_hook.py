"""DDP's bucketed gradient reduction through any GradSync: ``hook`` and ``wrap``.

``wrap(model, sync)`` is ``DistributedDataParallel`` over a ``SyncProcessGroup(sync)``
with ``hook`` averaging its gradient buckets: a location every rank shares is enough,
without ``init_process_group``. ``hook`` also fits a DDP built any other way
(docs/ddp.md#the-comm-hook).
"""

# no ``from __future__ import annotations`` here: DDP compares ``hook``'s annotations
# with the real objects (dist.GradBucket, Future[torch.Tensor]) at registration

import weakref

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from ferrosync.api import GradSync
from ferrosync.ddp.process_group import SyncProcessGroup
from ferrosync.errors import ConfigError, LayoutMismatch

__all__ = ["hook", "wrap"]

# per GradSync: bucket index -> the parameter shapes already checked against every rank
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_bucket(sync: GradSync, bucket: dist.GradBucket) -> None:
    """Verify once per bucket layout that every rank's bucket holds the same parameters.

    ``average_`` alone compares only the flat buffer's size. This adds one
    zero-byte collective per bucket index whenever the layout changes (at the first
    step and when DDP rebuilds its buckets): its layout digest covers the index and
    every parameter's shape, so differing buckets raise ``LayoutMismatch`` naming them.
    """
    shapes = tuple(tuple(p.shape) for p in bucket.parameters())
    index = bucket.index()
    seen = _CHECKED.setdefault(sync, {})
    if seen.get(index) == shapes:
        return
    dtype = bucket.buffer().dtype
    probe = [torch.empty((0, index), dtype=dtype)]
    probe += [torch.empty((0, *shape), dtype=dtype) for shape in shapes]
    try:
        sync.average_(probe)
    except LayoutMismatch as exc:
        raise LayoutMismatch(
            f"DDP gradient bucket {index} holds different parameters on different ranks "
            f"({exc.what}; tensor 0 encodes the bucket index as [0, index], tensor i > 0 the "
            "shape of the bucket's parameter i-1 as [0, *shape])",
            rank=exc.rank, collective=exc.collective, path=exc.path,
            hint="every rank must build the same model and call DDP with the same "
            "bucket_cap_mb / find_unused_parameters settings",
        ) from exc
    seen[index] = shapes


def hook(sync: GradSync, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP communication hook: average a gradient bucket through ``sync``.

    Register with ``ddp.register_comm_hook(sync, ferrosync.ddp.hook)``. DDP calls it
    on every rank for every bucket, in bucket order; it returns once the bucket
    holds Σ_r grad_r / W, bit-identical on every rank. With ``wire_dtype="topk"`` on
    ``sync`` this is sparse gradient averaging with error feedback (DGC) per bucket:
    DDP hands the hook the same bucket tensors every step, so each keeps its residual.
    Errors (a failed peer, a timeout, different buckets on different ranks) are raised
    from ``backward()``.
    """
    if not isinstance(sync, GradSync):
        raise ConfigError(f"the hook's state must be a GradSync, got {type(sync).__name__}",
                          hint="ddp.register_comm_hook(ferrosync.connect(url), "
                          "ferrosync.ddp.hook)")
    _check_bucket(sync, bucket)
    buffer = bucket.buffer()
    sync.average_(buffer)
    future: Future[torch.Tensor] = Future()
    future.set_result(buffer)
    return future


def wrap(model: torch.nn.Module, sync: GradSync, **ddp_kwargs) -> DistributedDataParallel:
    """``DistributedDataParallel(model, **ddp_kwargs)`` with every collective on ``sync``.

    Collective: every rank calls it with the same model architecture and kwargs.
    Without a ``process_group`` in ``ddp_kwargs`` DDP runs over a
    ``SyncProcessGroup(sync)``: rank 0's parameters and buffers reach every rank now,
    buffers again before each forward (``broadcast_buffers=True``, DDP's default), and
    gradients are averaged by ``hook``. With an explicit ``process_group`` smaller
    than ``sync``'s world, parameters and buffers are broadcast through ``sync`` once
    here so that every rank starts from rank 0's weights; later buffer broadcasts
    reach only that group.

    ``sync`` stays open; close it after training.
    """
    if not isinstance(sync, GradSync):
        raise ConfigError(f"wrap needs a GradSync, got {type(sync).__name__}",
                          hint="sync = ferrosync.connect(url)")
    group = ddp_kwargs.get("process_group")
    if group is None:
        ddp_kwargs["process_group"] = SyncProcessGroup(sync)
    elif group.size() != sync.world_size:
        state = [t.detach() for t in (*model.parameters(), *model.buffers())]
        sync.broadcast_(state, src=0)
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    ddp.register_comm_hook(sync, hook)
    return ddp
