"""One warning per process when a torch object collective (``broadcast_object_list``
and the like, which unpickle what other ranks sent) runs on a ``"ferrosync"`` group
whose storage objects carry no MAC: anyone who can write to the storage could then
run code in every rank. The warning says how to set a secret; gloo and nccl groups
never touch storage and are never warned about."""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

from ferrosync.core.env import ENV_SECRET
from ferrosync.errors import ObjectCollectiveWarning

if TYPE_CHECKING:
    from ferrosync.api import GradSync

__all__ = ["warn_object_collective"]


#: torch's collectives that pickle on one rank and unpickle on the others
_OBJECT_COLLECTIVES = frozenset({"broadcast_object_list", "all_gather_object", "gather_object",
                                 "scatter_object_list", "send_object_list",
                                 "recv_object_list"})
_objects_warned = False  # one warning per process


def _object_collective_calling(depth: int = 12) -> str | None:
    """The torch object collective (``broadcast_object_list``, ...) this call comes
    from, found on the calling thread's stack; None for a tensor collective."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name in _OBJECT_COLLECTIVES and str(
                frame.f_globals.get("__name__", "")).startswith("torch.distributed"):
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def warn_object_collective(sync: GradSync) -> None:
    """Warn once per process when an object collective runs without a secret."""
    global _objects_warned
    if _objects_warned or not sync.unauthenticated_storage:
        return
    name = _object_collective_calling()
    if name is None:
        return
    _objects_warned = True
    warnings.warn(
        f"rank {sync.rank}: {name} on the ferrosync process group at {sync.url} runs "
        "without a secret: object collectives unpickle what other ranks wrote to shared "
        "storage, and without a secret anyone who can write there can replace those "
        "bytes (their checksum needs no key) and run code in every rank. Set the same "
        f"secret on every rank: {ENV_SECRET}=<random string> in each rank's environment "
        "(python -m ferrosync.train gives the ranks it launches one) or "
        "pg_options={'secret': ...}; docs/ddp.md#security-of-object-collectives",
        ObjectCollectiveWarning, stacklevel=4)
