"""Backend options: one frozen dataclass per backend, the single home of every option's
name, default, validation and description.

``connect(url, **options)`` hands the keyword arguments to the backend's
``check_options``, which calls ``Options.parse``: unknown names and bad values are a
``ConfigError`` before any I/O, and the backend reads typed attributes
(``opts.reduce``), never string keys. docs/reference.md's option tables are generated from
the same fields (``table()``; each backend's registration in ``ferrosync/core/registry.py``
names its options class, ``python tools/docs/options_table.py`` rewrites the tables and
``tests/test_docs.py`` checks they match), so the documentation cannot drift from the
code.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed

from ferrosync.compression.codecs import (
    TOPK_BITS,
    TOPK_BITS_RANGE,
    TOPK_DENSITY,
    TOPK_DENSITY_SHOWN,
    check_topk_bits,
    check_topk_density,
    check_wire_dtype,
)
from ferrosync.core import validate
from ferrosync.core.env import ENV_JOB, ENV_SECRET, discover_job
from ferrosync.errors import ConfigError
from ferrosync.storage.engines.fsspec_store import FsspecStorage
from ferrosync.storage.engines.local import LocalStorage
from ferrosync.storage.engines.parts import MIN_PART, Transfer

REDUCE_MODES = ("root", "sharded", "gather", "auto")
LOCAL_MODES = ("gloo", "nccl", "auto")


def option(default: Any, doc: str, *, shown=None, check=None, documented: bool = True,
           shared: bool = False):
    """A dataclass field carrying its description (``doc``), how the docs show its
    default (``shown``: text, or a function of the options class for a default that
    lives elsewhere, e.g. in the storage engines), its validator
    ``check(name, value) -> value``, and whether every rank of a job must pass the
    same value (``shared``: the one list of such settings, ``shared_settings``)."""
    return field(default=default, metadata={"doc": doc, "shown": shown, "check": check,
                                            "documented": documented, "shared": shared})


def duration(seconds: float) -> str:
    """``seconds`` as the docs write a duration: 20 µs, 5 ms, 10 s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def per_store(local: float, object_store: float) -> str:
    """A default that depends on the kind of store, as the docs show it."""
    return f"{duration(local)} local, {duration(object_store)} object stores"


#: the engines' own timing defaults (``storage/engines/local.py``,
#: ``storage/engines/fsspec_store.py``), shown in the option tables from there
_LOCAL, _REMOTE = LocalStorage, FsspecStorage


# -- validators: check(name, value) -> normalised value -------------------------------------

def _positive_or_none(name, value):
    return validate.number(name, value, positive=True, allow_none=True)


def _positive(name, value):
    return validate.number(name, value, positive=True)


def _positive_int_or_none(name, value):
    return validate.integer(name, value, minimum=1, allow_none=True)


def _positive_int(name, value):
    return validate.integer(name, value, minimum=1)


def _fan_in(name, value):
    return validate.integer(name, value, minimum=2)


def _seconds_or_none(name, value):
    return validate.number(name, value, minimum=0, allow_none=True, unit="seconds")


def _boolean(name, value):
    return validate.boolean(name, value)


def _wire_dtype(_name, value):
    return check_wire_dtype(value)


def _topk_density(*, shared: bool):
    return option(
        TOPK_DENSITY, f"with `wire_dtype=\"topk\"`: the share of each 4096-value chunk "
        f"sent, in {TOPK_DENSITY_SHOWN}", shown="1/64", check=check_topk_density,
        shared=shared)


def _topk_bits(*, shared: bool):
    lo, hi = TOPK_BITS_RANGE
    return option(
        TOPK_BITS, f"with `wire_dtype=\"topk\"`: bits per value sent, in [{lo}, {hi}]",
        shown=str(TOPK_BITS), check=check_topk_bits, shared=shared)


def _reduce(name, value):
    return validate.choice(name, value, REDUCE_MODES)


def _local(name, value):
    return validate.choice(name, value, LOCAL_MODES)


def _non_negative_int(name, value):
    return validate.integer(name, value, minimum=0)


def _non_negative_int_or_none(name, value):
    return validate.integer(name, value, minimum=0, allow_none=True)


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


def _dict_or_none(name, value):
    if value is not None and not isinstance(value, dict):
        raise validate.error(name, "a dict", value, got=type(value).__name__)
    return value


def _device_or_none(name, value):
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise validate.error(name, "'cpu' or 'cuda'", value) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{name}='cuda' but CUDA is not available",
                          hint=f"drop {name} or use 'cpu'")
    return device


def _str_or_none(name, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise validate.error(name, "a non-empty path", value)
    return value


# -- the schema -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BackendOptions:
    """Base: parsing, unknown-name errors and the docs table, shared by every backend."""

    #: how error messages name the URLs this backend serves
    scope: ClassVar[str] = "this URL"

    #: how the table words a shared setting (see ``option(shared=...)``)
    shared_doc: ClassVar[str] = "every rank of a job must pass the same"

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if "doc" in f.metadata]

    @classmethod
    def shared_names(cls) -> tuple[str, ...]:
        """The settings every rank of a job must share (fields marked ``shared``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("shared"))

    @classmethod
    def shared_defaults(cls) -> dict:
        """The default of each shared setting (what a record that predates it means)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        return {name: fields[name].default for name in cls.shared_names()}

    def shared_settings(self) -> dict:
        """This rank's values of the settings every rank of the job must share, by name
        (checked at the rendezvous, or against an elastic job's record)."""
        return {name: getattr(self, name) for name in self.shared_names()}

    @classmethod
    def parse(cls, options: dict, *, tolerated: tuple[str, ...] = ()):
        """Validate ``options`` (user keyword arguments): a ``ConfigError`` names the first
        unknown option or bad value. Names in ``tolerated`` are accepted and dropped."""
        known = cls.names()
        unknown = sorted(set(options) - set(known) - set(tolerated))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown} for {cls.scope}{_elsewhere(unknown)}",
                hint="valid options: " + ", ".join(sorted({*known, *tolerated})),
            )
        values = {}
        for f in dataclasses.fields(cls):
            if "doc" not in f.metadata:
                continue
            value = options.get(f.name, f.default)
            check = f.metadata["check"]
            values[f.name] = check(f.name, value) if check is not None else value
        parsed = cls(**values)
        parsed._check_together()
        if getattr(parsed, "wire_dtype", None) == "topk" and not getattr(
                parsed, "error_feedback", True):
            # legal, but every sync then drops what it does not send (~98 %) for good
            warnings.warn("ferrosync: wire_dtype='topk' with error_feedback=False loses "
                          "every value a sync does not send; keep error_feedback=True "
                          "unless that is what you measure", stacklevel=4)
        return parsed

    def _check_together(self) -> None:
        """Rules between options (after each one is valid on its own)."""

    @classmethod
    def table(cls) -> str:
        """The markdown table of documented options (docs/reference.md)."""
        rows = ["| option | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if "doc" not in meta or not meta["documented"]:
                continue
            shown = meta["shown"] if meta["shown"] is not None else f"`{f.default!r}`"
            if callable(shown):
                shown = shown(cls)
            doc = meta["doc"] + (f"; {cls.shared_doc}" if meta["shared"] else "")
            rows.append(f"| `{f.name}` | {shown} | {doc} |")
        return "\n".join(rows)


@dataclass(frozen=True)
class Timing:
    """Polling and liveness of a storage-backed backend, resolved against the store."""

    poll: tuple[float, float]  # (first sleep, longest sleep) while polling one name
    heartbeat_interval: float
    heartbeat_timeout: float


class _StorageTiming:
    """``timing(storage)``: the one place where a storage-backed backend's polling and
    liveness options meet the store's defaults, and where a timeout too short for the
    interval is refused (a peer would look dead between two of its beats). Called
    right after the backend opened ``storage``, before anything else: a refusal
    closes it."""

    #: with ``heartbeat_timeout`` unset: this, or 3 heartbeat intervals if longer (and
    #: with only the timeout set, the default interval shrinks to a third of it)
    timeout_local: ClassVar[float] = 20.0
    timeout_object_store: ClassVar[float] = 20.0
    #: with ``heartbeat_interval`` unset on an object store: this (None: the store's own)
    interval_object_store: ClassVar[float | None] = None

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


def _transfer_size(name, value):
    return validate.integer(name, value, minimum=MIN_PART, allow_none=True)


def _mib(nbytes: int) -> str:
    return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


@dataclass(frozen=True)
class _ObjectTransfer(BackendOptions):
    """How an object store moves one object (``storage/engines/parts.py``): the storage-backed
    backends' options, given to the store as it is opened (``transfer()``)."""

    max_request_bytes: int | None = option(
        None, "the largest request body sent to an object store: a larger object is "
        "written as parts and a manifest (docs/design.md#large-objects)",
        shown=f"{_mib(Transfer.max_request_bytes)} (S3's single-PUT limit)",
        check=_transfer_size)
    part_bytes: int | None = option(
        None, "an object store's part (of a write larger than it) and ranged GET",
        shown=_mib(Transfer.part_bytes), check=_transfer_size)
    transfer_concurrency: int | None = option(
        None, "an object store's parts or ranges of one object in flight",
        shown=str(Transfer.concurrency), check=_positive_int_or_none)

    def transfer(self) -> dict:
        """``open_storage``'s ``transfer``: what was set (None: the store's default)."""
        return {"max_request_bytes": self.max_request_bytes, "part_bytes": self.part_bytes,
                "concurrency": self.transfer_concurrency}


@dataclass(frozen=True)
class StorageOptions(_StorageTiming, _ObjectTransfer):
    """Options of the storage backend (directories and fsspec object stores)."""

    scope: ClassVar[str] = "a storage URL"

    shared_doc: ClassVar[str] = "every rank must pass the same (checked at connect)"

    reduce: str = option(
        "auto", "`\"root\"`: rank 0 reduces; `\"sharded\"`: every rank reduces 1/W of the "
        "payload; `\"gather\"`: every rank reads every contribution and reduces all of it "
        "(one round trip instead of two); `\"auto\"`: gather on an object store up to "
        "`gather_max_ranks` ranks, else sharded from `sharded_min_bytes` up, else root "
        "(each where it measured faster)",
        shown='`"auto"`', check=_reduce, shared=True)
    wire_dtype: str | None = option(
        None, "payload encoding: native, `\"float32\"`, `\"bfloat16\"`, `\"float16\"`, "
        "`\"int8\"` (block scales + error feedback), or `\"topk\"` (the largest values of "
        "each chunk in a few bits + error feedback; averaged by gathering: docs/topk.md)",
        shown="`None`", check=_wire_dtype, shared=True)
    topk_density: float = _topk_density(shared=True)
    topk_bits: int = _topk_bits(shared=True)
    job: str | None = option(
        None, "job id: jobs with different ids never meet on one URL; "
        "`python -m ferrosync.train` names each launch",
        shown=f"`${ENV_JOB}`, else `SLURM_JOB_ID`, else `TORCHELASTIC_RUN_ID`", check=_job)
    claim_window: float | None = option(
        None, "how long each rank waits before its first collective so a second job "
        "started on the same URL at the same moment is caught (`DuplicateRank`) instead "
        "of averaged with", shown=lambda cls: _claim_window(), check=_seconds_or_none)
    secret: bytes | None = option(
        None, "shared key: every object carries an HMAC-SHA256 (keyed per job); anything "
        "without a valid one is rejected", shown=f"`${ENV_SECRET}`", check=_secret)
    storage_options: dict | None = option(
        None, "passed to the fsspec filesystem (credentials, `endpoint_url`, ...)",
        shown="`None`", check=_dict_or_none)
    heartbeat_interval: float | None = option(
        None, "seconds between heartbeats",
        shown=lambda cls: per_store(_LOCAL.heartbeat_interval, _REMOTE.heartbeat_interval),
        check=_positive_or_none)
    heartbeat_timeout: float = option(
        _StorageTiming.timeout_local, "liveness: a peer silent this long raises "
        "`PeerFailed` (must exceed twice `heartbeat_interval`)",
        shown=lambda cls: duration(cls.timeout_local), check=_positive)
    poll_initial: float | None = option(
        None, "first polling sleep for one exact name, seconds",
        shown=lambda cls: per_store(_LOCAL.poll_initial, _REMOTE.poll_initial),
        check=_positive_or_none)
    poll_max: float | None = option(
        None, "longest polling sleep, seconds",
        shown=lambda cls: per_store(_LOCAL.poll_max, _REMOTE.poll_max),
        check=_positive_or_none)
    bucket_bytes: int | None = option(
        None, "split a call's tensors into objects of at most this size",
        shown="unlimited", check=_positive_int_or_none, shared=True)
    chunk_bytes: int = option(
        8 << 20, "streaming read size (bounds the reducer's extra memory)",
        shown="8 MiB", check=_positive_int)
    reduce_device: torch.device | None = option(
        None, "where to accumulate (`\"cpu\"` or `\"cuda\"`)", shown="tensors' device",
        check=_device_or_none)
    error_feedback: bool = option(
        True, "carry int8 and topk quantisation error to the next call", shown="`True`",
        check=_boolean)
    # measured (tools/bench/bench.py, 2 and 4 ranks): sharded wins from 1 MiB up, root below
    sharded_min_bytes: int = option(
        1 << 20, "with `reduce=\"auto\"`: shard payloads at least this large",
        shown="1 MiB", check=_positive_int, shared=True)

    gather_max_ranks: int = option(
        2, "with `reduce=\"auto\"` on an object store: gather up to this many ranks (each "
        "reads W-1 contributions, so the bytes read grow with W)", shown="2",
        check=_non_negative_int, shared=True)

    def _check_together(self) -> None:
        _check_polls(self)
        if self.wire_dtype == "topk" and self.reduce in ("root", "sharded"):
            raise ConfigError(
                f"wire_dtype='topk' cannot use reduce={self.reduce!r}: the average of sparse "
                "contributions is dense, and publishing it would send it dense or re-sparsify "
                "it (lossy)", hint="use reduce='gather' or 'auto' (topk always gathers)")


@dataclass(frozen=True)
class TorchOptions(BackendOptions):
    """Options of the torch.distributed backend (``gloo://``, ``nccl://``, ``torch://``)."""

    scope: ClassVar[str] = "a torch.distributed URL"

    bucket_bytes: int | None = option(
        25 << 20, "flatten tensors into buckets of at most this many bytes", shown="25 MiB",
        check=_positive_int_or_none)
    wire_dtype: str | None = option(
        None, "`None` (native), `\"float32\"`, `\"bfloat16\"`, `\"float16\"`, `\"int8\"` or "
        "`\"topk\"`", shown="`None`", check=_wire_dtype)
    topk_density: float = _topk_density(shared=False)
    topk_bits: int = _topk_bits(shared=False)
    error_feedback: bool = option(
        True, "carry int8 and topk quantisation error to the next call", shown="`True`",
        check=_boolean)

    @classmethod
    def parse(cls, options: dict, *, tolerated: tuple[str, ...] = ()):
        """Storage-only options are accepted with one warning, so switching a script's
        URL from a bucket to ``gloo://`` never breaks it."""
        storage_only = sorted(set(StorageOptions.names()) - set(cls.names()))
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

    scope: ClassVar[str] = "a storage URL with local="

    local: str = option(None, "intra-node transport: `\"gloo\"`, `\"nccl\"` or `\"auto\"`",
                        shown="off", check=_local)
    local_rank: int | None = option(
        None, "this rank's index within its node", shown="environment",
        check=_non_negative_int_or_none)
    local_world_size: int | None = option(
        None, "ranks per node", shown="environment", check=_non_negative_int_or_none)
    local_dir: str | None = option(
        None, "node-local directory for the local rendezvous",
        shown="`/dev/shm/ferrosync-<uid>`", check=_str_or_none)
    storage: StorageOptions = field(default_factory=StorageOptions)

    @classmethod
    def parse(cls, options: dict, *, tolerated: tuple[str, ...] = ()):
        mine = {k: v for k, v in options.items() if k in cls.names()}
        rest = {k: v for k, v in options.items() if k not in cls.names()}
        storage = StorageOptions.parse(rest, tolerated=tolerated)
        parsed = super().parse(mine)
        return dataclasses.replace(parsed, storage=storage)

    def _check_together(self) -> None:
        if self.local == "nccl" and not (torch.cuda.is_available()
                                         and torch.distributed.is_nccl_available()):
            raise ConfigError("local='nccl' needs CUDA GPUs and NCCL; none are available",
                              hint="use local='gloo' for CPU tensors")


@dataclass(frozen=True)
class ElasticOptions(_StorageTiming, _ObjectTransfer):
    """Options of an elastic job's member (``connect(url, elastic=True)``,
    docs/elastic.md): the storage transport's, less what a roster decides (``reduce``,
    buckets), plus the job's ``spec``."""

    scope: ClassVar[str] = "an elastic job"
    shared_doc: ClassVar[str] = ("every member of a job must pass the same (the job's "
                                 "record says which)")
    # On an object store every beat is a billed PUT, and an elastic job may have
    # hundreds of members: one beat per 10 s is 360 k PUTs an hour at 1,000 members
    # ($1.80 at S3 list prices, docs/elastic.md#cost). A silent death still leaves the
    # roster within heartbeat_timeout + heartbeat_interval; a preempted member that
    # gets SIGTERM says it left and is dropped in the next round whatever these are.
    interval_object_store: ClassVar[float | None] = 10.0
    timeout_object_store: ClassVar[float] = 30.0

    job: str | None = option(
        None, "job id: elastic jobs with different ids never meet; their objects live in "
        "`el.{job}/`", shown=f"`${ENV_JOB}`, else the scheduler's job id", check=_job)
    secret: bytes | None = option(
        None, "shared key: every record and object is sealed with a key derived from it "
        "per job (HMAC-SHA256); anything without a valid one is refused",
        shown=f"`${ENV_SECRET}`", check=_secret)
    storage_options: dict | None = option(
        None, "passed to the fsspec filesystem (credentials, `endpoint_url`, ...)",
        shown="`None`", check=_dict_or_none)
    heartbeat_interval: float | None = option(
        None, "seconds between heartbeats",
        shown=lambda cls: per_store(_LOCAL.heartbeat_interval, cls.interval_object_store),
        check=_positive_or_none)
    heartbeat_timeout: float | None = option(
        None, "a member silent this long is dropped (members silent together leave "
        "together); must exceed twice `heartbeat_interval`",
        shown=lambda cls: per_store(cls.timeout_local, cls.timeout_object_store)
        + " (at least 3 intervals; an unset interval is at most a third of it)",
        check=_positive_or_none)
    poll_initial: float | None = option(
        None, "first polling sleep, seconds",
        shown=lambda cls: per_store(_LOCAL.poll_initial, _REMOTE.poll_initial),
        check=_positive_or_none)
    poll_max: float | None = option(
        None, "longest polling sleep, seconds",
        shown=lambda cls: per_store(_LOCAL.poll_max, _REMOTE.poll_max),
        check=_positive_or_none)
    elastic: bool = option(
        False, "join an elastic job on a storage URL (docs/elastic.md): members come and "
        "go, and `rank`/`world_size` follow the membership agreed each round (they cannot "
        "be passed)", shown="`False`", check=_boolean)
    min_ranks: int = option(
        1, "the fewest members a round waits for (connect returns once a roster of at "
        "least this many admits this member)", shown="1", check=_positive_int)
    max_ranks: int | None = option(
        None, "the most members a round admits (joiners beyond it wait in the queue)",
        shown="unlimited", check=_positive_int_or_none)
    wire_dtype: str | None = option(
        None, "contribution encoding: native, `\"float32\"`, `\"bfloat16\"`, `\"float16\"`, "
        "`\"int8\"` (block scales + error feedback, kept per member) or `\"topk\"` (a flat "
        "round at every size: docs/topk.md)", shown="`None`", check=_wire_dtype, shared=True)
    topk_density: float = _topk_density(shared=True)
    topk_bits: int = _topk_bits(shared=True)
    error_feedback: bool = option(
        True, "carry int8 and topk quantisation error to this member's next contribution",
        shown="`True`", check=_boolean)
    fan_in: int = option(
        8, "members per group of the tree reduce that averages from 5 members on "
        "(each member reads under 2.5 × the payload per round, whatever the membership)",
        shown="8", check=_fan_in, shared=True)
    spec: dict | None = option(
        None, "what every member must agree on (plain JSON; the trainer's: model "
        "fingerprint, optimizer and lr, strategy, steps, batch size, seed): a newcomer "
        "whose spec differs from the job's record is refused before it writes anything",
        shown="`None`", check=_dict_or_none)

    def _check_together(self) -> None:
        _check_polls(self)
        if self.max_ranks is not None and self.max_ranks < self.min_ranks:
            raise ConfigError(f"max_ranks ({self.max_ranks}) must be >= min_ranks "
                              f"({self.min_ranks})")


def _claim_window() -> str:
    from ferrosync.storage.rendezvous import ANONYMOUS_CLAIM_WINDOW  # the rendezvous's own default

    return f"{duration(ANONYMOUS_CLAIM_WINDOW)} without a job id, else 0"


def _check_polls(options) -> None:
    if options.poll_initial and options.poll_max and options.poll_initial > options.poll_max:
        raise ConfigError("poll_initial must not exceed poll_max")


def _elsewhere(unknown: list[str]) -> str:
    """Where the ``unknown`` options belong, when another backend takes them: ``connect``
    picks the backend by the URL and the selecting options (``core/registry.py``)."""
    from ferrosync.core.registry import REGISTRY

    notes = []
    for entry in REGISTRY.values():
        cls = entry.load_options()
        theirs = [name for name in unknown if name in cls.names()]
        if theirs and entry.option is not None:
            notes.append(f"{', '.join(theirs)} apply to {cls.scope} only ({entry.option}=...)")
    return f" ({'; '.join(notes)})" if notes else ""
