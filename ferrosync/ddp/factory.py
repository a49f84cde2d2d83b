"""The backend factory torch calls for ``init_process_group("ferrosync")`` and ``new_group``.

``create_backend`` connects a storage ``GradSync`` for the group (location from the
init_method, job id from torch's store: ``job.py``) and wraps it in a
``SyncProcessGroup``; ``attach_placeholders`` makes that group look like a built-in
one to torch (device types, a name).
"""

from __future__ import annotations

import json
import os
import re
import warnings

import torch
import torch.distributed as dist

from ferrosync.api import connect
from ferrosync.core import validate
from ferrosync.core.env import ENV_URL, discover_job
from ferrosync.ddp.constants import BACKEND_NAME, ENV_PG_OPTIONS
from ferrosync.ddp.init_methods import location_of
from ferrosync.ddp.job import group_job
from ferrosync.ddp.process_group import SyncProcessGroup, sync_of
from ferrosync.errors import ConfigError

__all__ = ["create_backend", "attach_placeholders", "PLACEHOLDER_TESTED_TORCH"]


# -- looking like a real torch group ---------------------------------------------------------

#: torch versions on which ``_attach_placeholders`` is tested (tests/test_pg_torch_features.py)
PLACEHOLDER_TESTED_TORCH = ("2.13",)


def attach_placeholders(pg: SyncProcessGroup, group_name: str) -> bool:
    """Register a placeholder c10d ``Backend`` per device on ``pg`` (private torch API).

    torch keeps a group's device types and its name in its C++ backends
    (``ProcessGroup::setBackend``, ``getGroupName``), and a Python ``ProcessGroup``
    has none, so ``pg._device_types`` is empty and ``group_name`` raises: DeviceMesh,
    functional collectives, FSDP2 and DCP then refuse the group. A Python class cannot
    subclass ``torch._C._distributed_c10d.Backend``, so the placeholder is torch's
    ``FakeProcessGroup`` with ``error_on_collective=True``: every collective that would
    reach it raises instead of silently doing nothing. The real collectives stay
    ``SyncProcessGroup``'s methods, which torch's C++ reaches through the Python
    ProcessGroup trampoline (``torch/csrc/distributed/c10d/PyProcessGroup.hpp``), or
    directly from Python. The trampoline does not forward every method (e.g.
    ``recvAnysource``, coalescing); those are reached from Python only, where
    ``SyncProcessGroup`` defines them, and ``FakeProcessGroup``'s send/recv, which
    ignore ``error_on_collective``, are shadowed by ours. tests/test_pg_torch_features.py
    checks that no collective reaches the placeholder.

    Private API used: ``torch._C._distributed_c10d.FakeProcessGroup._create_internal``
    and ``.Options.error_on_collective``, ``ProcessGroup._register_backend``,
    ``ProcessGroup.BackendType.CUSTOM``, ``ProcessGroup._set_group_name`` (torch's own
    ``_new_process_group_helper`` sets the same name again after the factory returns).
    Tested on the torch versions in ``PLACEHOLDER_TESTED_TORCH``. Returns False, with
    a ``RuntimeWarning``, where this torch lacks the API; the group then works as a
    plain Python group (DDP and ``torch.distributed`` calls, not the above).
    """
    try:
        fake = torch._C._distributed_c10d.FakeProcessGroup
        options = fake.Options()
        options.error_on_collective = True
        placeholder = fake._create_internal(pg.rank(), pg.size(), options)
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM,
                                 placeholder)
        pg._set_group_name(str(group_name))
    except Exception as exc:  # an API change in a torch we are not tested on
        warnings.warn(f"ferrosync could not give its process group device types and a name "
                      f"on torch {torch.__version__} ({type(exc).__name__}: {exc}); "
                      "DeviceMesh, functional collectives, FSDP2 and DCP will refuse it",
                      RuntimeWarning, stacklevel=2)
        return False
    pg._placeholder = placeholder
    return True


# -- the backend factory -------------------------------------------------------------------

def _options(pg_options) -> dict:
    """``ferrosync.connect`` options: ``$FERROSYNC_PG_OPTIONS`` (JSON), then ``pg_options``."""
    options: dict = {}
    raw = os.environ.get(ENV_PG_OPTIONS, "").strip()
    if raw:
        try:
            options = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"{ENV_PG_OPTIONS} is not valid JSON ({exc})",
                              hint='set it to a JSON object such as {"secret": "..."}') from None
        if not isinstance(options, dict):
            raise ConfigError(f"{ENV_PG_OPTIONS} must be a JSON object, got {raw[:80]!r}")
    if pg_options is not None:
        if not isinstance(pg_options, dict):
            raise ConfigError(
                f"pg_options for backend {BACKEND_NAME!r} must be a dict of ferrosync.connect "
                f"options, got {type(pg_options).__name__}",
                hint="e.g. pg_options={'storage_options': {...}, 'secret': '...'}")
        options.update(pg_options)
    return options


def _parent_job() -> str | None:
    """The job id of the default process group, when it is a ``"ferrosync"`` group."""
    if not dist.is_initialized():
        return None
    return getattr(sync_of(dist.distributed_c10d._get_default_group()), "job", None)


def _group_suffix(group_id: str) -> str:
    return "group." + re.sub(r"[^A-Za-z0-9_.-]", "_", str(group_id))


def create_backend(backend_opts, pg_options) -> SyncProcessGroup:
    """torch's factory for backend "ferrosync" (registered with ``extended_api=True``).

    Collective over the group's ranks: connects every rank to the storage location
    named by the init_method (see ``init_methods``), or by ``pg_options["url"]`` /
    ``$FERROSYNC_URL`` when the init_method names none (``env://``, ``tcp://``).
    The world group uses the location itself, a subgroup ``<location>/group.<name>``.
    The init timeout bounds every wait. Option ``overlap`` (default true) is the
    group's, not ``connect``'s (see ``SyncProcessGroup``). Raises ``ConfigError`` (bad
    options, no location) or ``SyncTimeout`` (peers missing).
    """
    options = _options(pg_options)
    url = options.pop("url", None)
    location = location_of(backend_opts.store)
    if location is not None:
        if url is not None and url != location:
            raise ConfigError(
                f"pg_options url {url!r} differs from the init_method's location {location!r}",
                rank=backend_opts.group_rank, hint="give the location once")
        url = location
    url = url or os.environ.get(ENV_URL)
    if not url:
        raise ConfigError(
            f"backend {BACKEND_NAME!r} needs a storage location, and init_method names none",
            rank=backend_opts.group_rank,
            hint="use init_method='/shared/dir' or 's3://bucket/run', or set FERROSYNC_URL",
        )
    subgroup = bool(list(backend_opts.global_ranks_in_group))  # the world group has []
    if subgroup:
        url = url.rstrip("/") + "/" + _group_suffix(backend_opts.group_id)
    overlap = validate.boolean("overlap", options.pop("overlap", True),
                               rank=backend_opts.group_rank)
    timeout = backend_opts.timeout.total_seconds()
    if discover_job(options.get("job")) is None:
        # no job id given: this job's ranks share torch's store, which tells them from
        # another job's at once (no claim window); a subgroup inherits its parent's
        options["job"] = group_job(backend_opts.store, backend_opts.group_rank,
                                   backend_opts.group_size, timeout,
                                   inherited=_parent_job() if subgroup else None)
    sync = connect(url, rank=backend_opts.group_rank, world_size=backend_opts.group_size,
                   timeout=timeout, **options)
    pg = SyncProcessGroup(sync, owns_sync=True, overlap=overlap)
    attach_placeholders(pg, backend_opts.group_id)
    return pg
