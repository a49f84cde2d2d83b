"""The storage backend's options (``StorageOptions``) and the groups of options every
storage-backed backend shares: ``TimingOptions`` (polling and liveness, resolved against
the store by ``timing``), ``AccessOptions`` (job, secret, driver options) and
``TransferOptions`` (how an object store moves one object). How an option is declared,
parsed and documented: ``core/options.py``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from ferrosync.compression.options import CodecOptions
from ferrosync.core import validate
from ferrosync.core.env import ENV_JOB, ENV_SECRET, discover_job
from ferrosync.core.options import (
    BackendOptions,
    BucketOptions,
    device_or_none,
    dict_or_none,
    duration,
    mib,
    non_negative_int,
    option,
    per_store,
    positive_int,
    positive_int_or_none,
    positive_or_none,
    seconds_or_none,
)
from ferrosync.errors import ConfigError
from ferrosync.storage.engines.fsspec_store import FsspecStorage
from ferrosync.storage.engines.local import LocalStorage
from ferrosync.storage.engines.parts import MIN_PART, Transfer

REDUCE_MODES = ("root", "sharded", "gather", "auto")

#: the engines' own timing defaults (``storage/engines/local.py``,
#: ``storage/engines/fsspec_store.py``), shown in the option tables from there
_LOCAL, _REMOTE = LocalStorage, FsspecStorage


def _secret(_name, value):
    if value is None:
        value = os.environ.get(ENV_SECRET)
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, (bytes, bytearray)) or not value:
        raise validate.error("secret", "a non-empty str or bytes", value, got=type(value).__name__
                             if value else repr(value))
    return bytes(value)


def _job(_name, value):
    return discover_job(value)


def _reduce(name, value):
    return validate.choice(name, value, REDUCE_MODES)


def _transfer_size(name, value):
    return validate.integer(name, value, minimum=MIN_PART, allow_none=True)


def _heartbeat_timeout_shown(cls) -> str:
    default = cls.default("heartbeat_timeout")
    if default is not None:
        return duration(default)
    return (per_store(cls.timeout_local, cls.timeout_object_store)
            + " (at least 3 intervals; an unset interval is at most a third of it)")


# -- groups of the storage-backed backends (the storage backend and an elastic job's member)

@dataclass(frozen=True)
class Timing:
    """Polling and liveness of a storage-backed backend, resolved against the store."""

    poll: tuple[float, float]  # (first sleep, longest sleep) while polling one name
    heartbeat_interval: float
    heartbeat_timeout: float


@dataclass(frozen=True)
class TimingOptions:
    """Polling and liveness. ``timing(storage)`` is the one place where these options
    meet the store's defaults, and where a timeout too short for the interval is refused
    (a peer would look dead between two of its beats). Called right after the backend
    opened ``storage``, before anything else: a refusal closes it."""

    #: with ``heartbeat_timeout`` unset: this, or 3 heartbeat intervals if longer (and
    #: with only the timeout set, the default interval shrinks to a third of it)
    timeout_local: ClassVar[float] = 20.0
    timeout_object_store: ClassVar[float] = 20.0
    #: with ``heartbeat_interval`` unset on an object store: this (None: the store's own)
    interval_object_store: ClassVar[float | None] = None

    heartbeat_interval: float | None = option(
        None, "seconds between heartbeats",
        shown=lambda cls: per_store(_LOCAL.heartbeat_interval,
                                    cls.interval_object_store or _REMOTE.heartbeat_interval),
        check=positive_or_none)
    heartbeat_timeout: float | None = option(
        None, "liveness: a peer silent this long raises `PeerFailed`, an elastic job's "
        "member is dropped (members silent together leave together); must exceed twice "
        "`heartbeat_interval`", shown=_heartbeat_timeout_shown, check=positive_or_none)
    poll_initial: float | None = option(
        None, "first polling sleep for one exact name, seconds",
        shown=lambda cls: per_store(_LOCAL.poll_initial, _REMOTE.poll_initial),
        check=positive_or_none)
    poll_max: float | None = option(
        None, "longest polling sleep, seconds",
        shown=lambda cls: per_store(_LOCAL.poll_max, _REMOTE.poll_max),
        check=positive_or_none)

    def timing(self, storage) -> Timing:
        remote = storage.round_trips_dominate
        timeout = self.heartbeat_timeout
        interval = self.heartbeat_interval
        if interval is None:
            interval = (self.interval_object_store if remote and self.interval_object_store
                        else storage.heartbeat_interval)
            if timeout is not None:  # a timeout the user chose: beat at least 3 times in it
                interval = min(interval, timeout / 3)
        if timeout is None:
            timeout = max(self.timeout_object_store if remote else self.timeout_local,
                          3 * interval)
        if timeout <= 2 * interval:
            # the caller opened ``storage`` for these options and holds nothing else yet
            storage.close()
            raise ConfigError(
                f"heartbeat_timeout ({timeout:g} s) must exceed twice the heartbeat "
                f"interval ({interval:g} s)",
                hint="raise heartbeat_timeout or lower heartbeat_interval")
        poll = (self.poll_initial or storage.poll_initial, self.poll_max or storage.poll_max)
        return Timing(poll, interval, timeout)

    def check_polls(self) -> None:
        if self.poll_initial and self.poll_max and self.poll_initial > self.poll_max:
            raise ConfigError("poll_initial must not exceed poll_max")


@dataclass(frozen=True)
class AccessOptions:
    """Which job's objects a rank may meet, and how it reaches and authenticates them."""

    job: str | None = option(
        None, "job id: jobs with different ids never meet on one URL (an elastic job's "
        "objects live in `el.{job}/`); `python -m ferrosync.train` names each launch",
        shown=f"`${ENV_JOB}`, else `SLURM_JOB_ID`, else `TORCHELASTIC_RUN_ID`", check=_job)
    secret: bytes | None = option(
        None, "shared key: every object and record carries an HMAC-SHA256 (keyed per "
        "job); anything without a valid one is rejected", shown=f"`${ENV_SECRET}`",
        check=_secret)
    storage_options: dict | None = option(
        None, "passed to the fsspec filesystem (credentials, `endpoint_url`, ...)",
        shown="`None`", check=dict_or_none)


@dataclass(frozen=True)
class TransferOptions:
    """How an object store moves one object (``storage/engines/parts.py``), given to the
    store as it is opened (``transfer()``)."""

    max_request_bytes: int | None = option(
        None, "the largest request body sent to an object store: a larger object is "
        "written as parts and a manifest (docs/design.md#large-objects)",
        shown=f"{mib(Transfer.max_request_bytes)} (S3's single-PUT limit)",
        check=_transfer_size)
    part_bytes: int | None = option(
        None, "an object store's part (of a write larger than it) and ranged GET",
        shown=mib(Transfer.part_bytes), check=_transfer_size)
    transfer_concurrency: int | None = option(
        None, "an object store's parts or ranges of one object in flight",
        shown=str(Transfer.concurrency), check=positive_int_or_none)

    def transfer(self) -> dict:
        """``open_storage``'s ``transfer``: what was set (None: the store's default)."""
        return {"max_request_bytes": self.max_request_bytes, "part_bytes": self.part_bytes,
                "concurrency": self.transfer_concurrency}


# -- the storage backend --------------------------------------------------------------------

@dataclass(frozen=True)
class StorageOptions(BackendOptions, TimingOptions, AccessOptions, BucketOptions,
                     CodecOptions, TransferOptions):
    """Options of the storage backend (directories and fsspec object stores)."""

    scope = "a storage URL"
    shared_doc = "every rank must pass the same (checked at connect)"
    defaults = {"heartbeat_timeout": TimingOptions.timeout_local}

    reduce: str = option(
        "auto", "`\"root\"`: rank 0 reduces; `\"sharded\"`: every rank reduces 1/W of the "
        "payload; `\"gather\"`: every rank reads every contribution and reduces all of it "
        "(one round trip instead of two); `\"auto\"`: gather on an object store up to "
        "`gather_max_ranks` ranks, else sharded from `sharded_min_bytes` up, else root "
        "(each where it measured faster)",
        shown='`"auto"`', check=_reduce, shared=True)
    claim_window: float | None = option(
        None, "how long each rank waits before its first collective so a second job "
        "started on the same URL at the same moment is caught (`DuplicateRank`) instead "
        "of averaged with", shown=lambda cls: _claim_window(), check=seconds_or_none)
    chunk_bytes: int = option(
        8 << 20, "streaming read size (bounds the reducer's extra memory)",
        shown="8 MiB", check=positive_int)
    reduce_device: torch.device | None = option(
        None, "where to accumulate (`\"cpu\"` or `\"cuda\"`)", shown="tensors' device",
        check=device_or_none)
    # measured (tools/bench/bench.py, 2 and 4 ranks): sharded wins from 1 MiB up, root below
    sharded_min_bytes: int = option(
        1 << 20, "with `reduce=\"auto\"`: shard payloads at least this large",
        shown="1 MiB", check=positive_int, shared=True)

    gather_max_ranks: int = option(
        2, "with `reduce=\"auto\"` on an object store: gather up to this many ranks (each "
        "reads W-1 contributions, so the bytes read grow with W)", shown="2",
        check=non_negative_int, shared=True)

    def _check_together(self) -> None:
        self.check_polls()
        if self.wire_dtype == "topk" and self.reduce in ("root", "sharded"):
            raise ConfigError(
                f"wire_dtype='topk' cannot use reduce={self.reduce!r}: the average of sparse "
                "contributions is dense, and publishing it would send it dense or re-sparsify "
                "it (lossy)", hint="use reduce='gather' or 'auto' (topk always gathers)")


def _claim_window() -> str:
    from ferrosync.storage.rendezvous import ANONYMOUS_CLAIM_WINDOW  # the rendezvous's own default

    return f"{duration(ANONYMOUS_CLAIM_WINDOW)} without a job id, else 0"
