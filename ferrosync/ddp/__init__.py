"""DistributedDataParallel over a shared directory or an object store (docs/ddp.md).

Two routes over the storage backend: the ``"ferrosync"`` torch.distributed backend
(``init_process_group("ferrosync", init_method=URL)``), and ``wrap``/``hook``, a DDP
communication hook over any ``GradSync``. Registering with torch is
``ferrosync_autoload``'s alone (docs/design.md#registering-with-torch); only that runs
at ``import ferrosync``, the rest loads on first use.
"""

from __future__ import annotations

import importlib
import warnings

import torch
import torch.distributed as dist

import ferrosync_autoload
from ferrosync.ddp.constants import BACKEND_NAME, ENV_PG_OPTIONS

_LAZY = {
    "hook": "comm_hook",
    "wrap": "comm_hook",
    "SyncProcessGroup": "process_group",
}

__all__ = ["BACKEND_NAME", "ENV_PG_OPTIONS", "register", "register_scheme", "stats", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def stats(group=None) -> dict:
    """The ``stats`` of the GradSync behind a ``"ferrosync"`` process group: bytes,
    requests and seconds per phase, ``{"total": {...}, "last": {...}}`` as
    ``GradSync.stats`` (see ``ferrosync.core.stats``).

    Local (no collective, no I/O): this rank's numbers. ``group``: a process group
    (default: the default group, after ``init_process_group("ferrosync", ...)``) or
    the ``SyncProcessGroup`` that ``wrap`` built. Raises ``ConfigError`` when no group
    is initialised or the group runs another backend.
    """
    from ferrosync.ddp.process_group import sync_of
    from ferrosync.errors import ConfigError

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("ferrosync.ddp.stats(): no default process group",
                              hint="call dist.init_process_group('ferrosync', ...) first, or "
                              "pass group=")
        group = dist.distributed_c10d._get_default_group()
    found = sync_of(group)
    if found is None:
        name = getattr(group, "name", lambda: type(group).__name__)
        raise ConfigError(f"ferrosync.ddp.stats(): the group is not a {BACKEND_NAME!r} "
                          f"process group ({name() if callable(name) else name})",
                          hint=f"pass a group created with backend {BACKEND_NAME!r}")
    return found.stats


def register() -> bool:
    """Register backend ``"ferrosync"`` and its init_method handlers with torch, through
    the one registrar (``ferrosync_autoload.register``).

    Idempotent and cheap (imports nothing beyond torch); ``import ferrosync`` calls
    it. Returns False when this torch build has no ``torch.distributed``, or (with
    a ``RuntimeWarning``) when its registration API differs from the one ferrosync
    knows: ``connect`` and the rest of ferrosync keep working either way.
    """
    try:
        return ferrosync_autoload.register()
    except Exception as exc:  # a torch API change must not break `import ferrosync`
        warnings.warn(f"ferrosync could not register its torch.distributed backend with "
                      f"torch {torch.__version__} ({type(exc).__name__}: {exc}); "
                      "init_process_group('ferrosync') will not work, ferrosync.connect will",
                      RuntimeWarning, stacklevel=2)
        return False


def register_scheme(scheme: str) -> bool:
    """Accept ``scheme://bucket/prefix`` as an init_method naming an fsspec location
    (``ferrosync_autoload.register_scheme``); False when ``scheme`` has a handler."""
    return ferrosync_autoload.register_scheme(scheme)
