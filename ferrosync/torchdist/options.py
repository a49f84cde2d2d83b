"""Options of the torch.distributed backends: ``TorchOptions`` (``gloo://``, ``nccl://``,
``torch://``) and ``HierarchicalOptions`` (a storage URL with ``local=...``, whose leaders
take the storage backend's options, found through the registry)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed

from ferrosync.compression.options import CodecOptions
from ferrosync.core import validate
from ferrosync.core.options import (
    BackendOptions,
    BucketOptions,
    non_negative_int_or_none,
    option,
    str_or_none,
)
from ferrosync.core.registry import storage_registration
from ferrosync.errors import ConfigError

LOCAL_MODES = ("gloo", "nccl", "auto")


def _local(name, value):
    return validate.choice(name, value, LOCAL_MODES)


def _storage_options() -> type[BackendOptions]:
    return storage_registration().load_options()


@dataclass(frozen=True)
class TorchOptions(BackendOptions, BucketOptions, CodecOptions):
    """Options of the torch.distributed backend."""

    scope = "a torch.distributed URL"
    defaults = {"bucket_bytes": 25 << 20}

    @classmethod
    def parse(cls, options: dict, *, tolerated: tuple[str, ...] = ()):
        """Storage-only options are accepted with one warning, so switching a script's
        URL from a bucket to ``gloo://`` never breaks it."""
        storage_only = sorted(set(_storage_options().names()) - set(cls.names()))
        ignored = sorted(set(options) & set(storage_only))
        parsed = super().parse(options, tolerated=(*tolerated, *storage_only))
        if ignored:
            warnings.warn(
                f"ferrosync: options {ignored} only apply to storage URLs; the torch "
                "backend ignores them", stacklevel=4)
        return parsed


@dataclass(frozen=True)
class HierarchicalOptions(BackendOptions):
    """Options of the two-level backend (a storage URL with ``local=...``); every other
    option is the leaders' storage option (``storage``)."""

    scope = "a storage URL with local="

    local: str = option(None, "intra-node transport: `\"gloo\"`, `\"nccl\"` or `\"auto\"`",
                        shown="off", check=_local)
    local_rank: int | None = option(
        None, "this rank's index within its node", shown="environment",
        check=non_negative_int_or_none)
    local_world_size: int | None = option(
        None, "ranks per node", shown="environment", check=non_negative_int_or_none)
    local_dir: str | None = option(
        None, "node-local directory for the local rendezvous",
        shown="`/dev/shm/ferrosync-<uid>`", check=str_or_none)
    #: the leaders' options: the storage backend's options class (``StorageOptions``)
    storage: BackendOptions = field(default_factory=lambda: _storage_options()())

    @classmethod
    def parse(cls, options: dict, *, tolerated: tuple[str, ...] = ()):
        mine = {k: v for k, v in options.items() if k in cls.names()}
        rest = {k: v for k, v in options.items() if k not in cls.names()}
        storage = _storage_options().parse(rest, tolerated=tolerated)
        parsed = super().parse(mine)
        return dataclasses.replace(parsed, storage=storage)

    def _check_together(self) -> None:
        if self.local == "nccl" and not (torch.cuda.is_available()
                                         and torch.distributed.is_nccl_available()):
            raise ConfigError("local='nccl' needs CUDA GPUs and NCCL; none are available",
                              hint="use local='gloo' for CPU tensors")
