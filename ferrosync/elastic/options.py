"""Options of an elastic job's member (``connect(url, elastic=True)``, docs/elastic.md):
the storage groups it shares with the storage backend, less what a roster decides
(``reduce``, buckets), plus membership and the job's ``spec``."""

from __future__ import annotations

from dataclasses import dataclass

from ferrosync.compression.options import CodecOptions
from ferrosync.core import validate
from ferrosync.core.options import (
    BackendOptions,
    boolean,
    dict_or_none,
    option,
    positive_int,
    positive_int_or_none,
)
from ferrosync.errors import ConfigError
from ferrosync.storage.options import AccessOptions, TimingOptions, TransferOptions


def _fan_in(name, value):
    return validate.integer(name, value, minimum=2)


@dataclass(frozen=True)
class ElasticOptions(BackendOptions, TimingOptions, AccessOptions, CodecOptions,
                     TransferOptions):
    """Options of an elastic job's member."""

    scope = "an elastic job"
    shared_doc = "every member of a job must pass the same (the job's record says which)"
    # On an object store every beat is a billed PUT, and an elastic job may have
    # hundreds of members: one beat per 10 s is 360 k PUTs an hour at 1,000 members
    # ($1.80 at S3 list prices, docs/elastic.md#cost). A silent death still leaves the
    # roster within heartbeat_timeout + heartbeat_interval; a preempted member that
    # gets SIGTERM says it left and is dropped in the next round whatever these are.
    interval_object_store = 10.0
    timeout_object_store = 30.0

    elastic: bool = option(
        False, "join an elastic job on a storage URL (docs/elastic.md): members come and "
        "go, and `rank`/`world_size` follow the membership agreed each round (they cannot "
        "be passed)", shown="`False`", check=boolean)
    min_ranks: int = option(
        1, "the fewest members a round waits for (connect returns once a roster of at "
        "least this many admits this member)", shown="1", check=positive_int)
    max_ranks: int | None = option(
        None, "the most members a round admits (joiners beyond it wait in the queue)",
        shown="unlimited", check=positive_int_or_none)
    fan_in: int = option(
        8, "members per group of the tree reduce that averages from 5 members on "
        "(each member reads under 2.5 × the payload per round, whatever the membership)",
        shown="8", check=_fan_in, shared=True)
    spec: dict | None = option(
        None, "what every member must agree on (plain JSON; the trainer's: model "
        "fingerprint, optimizer and lr, strategy, steps, batch size, seed): a newcomer "
        "whose spec differs from the job's record is refused before it writes anything",
        shown="`None`", check=dict_or_none)

    def _check_together(self) -> None:
        self.check_polls()
        if self.max_ranks is not None and self.max_ranks < self.min_ranks:
            raise ConfigError(f"max_ranks ({self.max_ranks}) must be >= min_ranks "
                              f"({self.min_ranks})")
