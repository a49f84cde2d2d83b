"""Generations: how ranks agree on a fresh namespace, without listing the store.

A job restarted under the same URL must never read a file of an earlier attempt,
and two live processes claiming one rank must fail loudly. Every run therefore
gets a *generation* ``g``, and all its data lives below ``g{g}/``. The protocol
uses only write-once objects read by exact name (DESIGN.md §4.2, §4.3)::

    rdzv/join.r{rank}.{n}   rank's n-th attempt to join (n = 0, 1, 2, ...)
    rdzv/gen.{g}            rank 0's announcement of generation g: which attempt
                            of each rank it contains, and the shared settings

1. A rank r > 0 notes the first generation index ``g0`` not announced yet, then
   writes its next join record (create-exclusive where the store supports it)
   and waits for an announcement ``gen.{g >= g0}`` naming its join.
2. Rank 0 finds the first free index ``g``, reads ``gen.{g-1}`` to learn which
   attempts were consumed, waits until every rank has a *newer* join record, and
   announces ``gen.{g}``. So a rank only ever joins a generation announced after
   it started waiting, and a stale join of a dead process is never reused.

While waiting, each rank watches its own rank's heartbeat in the previous
generation: if that counter still moves, another live process holds the rank
and both sides get ``DuplicateRank`` (a process killed by SIGKILL does not
block a restart: its heartbeat never moves).

Indices are found by galloping probes (1, 2, 4, ... then bisection), so the cost
stays logarithmic in the number of restarts.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass

from .errors import ConfigError, DuplicateRank, SyncTimeout
from .liveness import heartbeat_key
from .storage import Backoff, Storage, object_exists
from .wire import decode_record, encode_record

RDZV = "rdzv"


def join_key(rank: int, attempt: int) -> str:
    return f"{RDZV}/join.r{rank}.{attempt}"


def gen_key(generation: int) -> str:
    return f"{RDZV}/gen.{generation}"


def gen_prefix(generation: int, token: str) -> str:
    """The generation's data prefix. The random token makes it unique even if the
    rendezvous records were deleted and a number is reused: a stale directory of
    an earlier attempt can never be mistaken for the current one."""
    return f"g{generation}.{token}"


@dataclass(frozen=True)
class Generation:
    number: int
    token: str  # 16 hex digits, random per announcement
    prefix: str
    settings: dict

    @property
    def tag(self) -> int:
        """The token as the 64-bit value every object header carries."""
        return int(self.token, 16)


def first_missing(storage: Storage, key_of, start: int = 0) -> int:
    """Smallest ``i >= start`` whose key does not exist (existence is prefix-closed)."""
    if not object_exists(storage, key_of(start)):
        return start
    low, step = start, 1  # key_of(low) exists
    while object_exists(storage, key_of(start + step)):
        low = start + step
        step *= 2
    high = start + step  # key_of(high) is missing
    while high - low > 1:
        mid = (low + high) // 2
        if object_exists(storage, key_of(mid)):
            low = mid
        else:
            high = mid
    return high


class _DuplicateWatch:
    """Raises DuplicateRank if ``rank``'s heartbeat in ``generation`` keeps moving."""

    def __init__(self, storage: Storage, previous: dict | None, rank: int,
                 key: bytes | None, interval: float) -> None:
        self._storage = storage
        self._generation = previous.get("generation") if previous else None
        self._prefix = (gen_prefix(previous["generation"], previous["token"])
                        if previous else None)
        self._rank = rank
        self._key = key
        self._interval = interval
        self._first = None
        self._next = time.monotonic()

    def poll(self) -> None:
        if self._generation is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self._interval
        path = heartbeat_key(self._prefix, self._rank)
        raw = self._storage.read(path)
        if raw is None:
            return
        try:
            record = decode_record(raw, self._key, path=self._storage.path_of(path))
        except Exception:
            return
        if record.get("state") != "running":
            self._generation = None  # that process ended cleanly or aborted
            return
        if self._first is None:
            self._first = record.get("beat")
        elif record.get("beat") != self._first:
            raise DuplicateRank(
                f"rank {self._rank} is still running in generation {self._generation} "
                f"(pid {record.get('pid')} on {record.get('host')}): two processes claim "
                f"rank {self._rank}",
                rank=self._rank, path=self._storage.path_of(path),
                hint="stop the old job first, or give each job its own URL and distinct ranks",
            )


def _read_announcement(storage: Storage, g: int, key: bytes | None) -> dict | None:
    if g < 0:
        return None
    raw = storage.read(gen_key(g))
    if raw is None:
        return None
    return decode_record(raw, key, path=storage.path_of(gen_key(g)))


def rendezvous(storage: Storage, rank: int, world_size: int, settings: dict, *,
               key: bytes | None, timeout: float, poll: tuple[float, float],
               heartbeat_interval: float, url: str) -> Generation:
    """Collective: every rank calls it once at connect; blocks until the generation
    is announced (rank 0 waits for every rank to join), at most ``timeout`` s."""
    storage.makedirs(RDZV)
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _announce(storage, world_size, settings, key, deadline, poll,
                         heartbeat_interval, url, timeout)
    return _join(storage, rank, world_size, settings, key, deadline, poll,
                 heartbeat_interval, url, timeout)


def _announce(storage, world_size, settings, key, deadline, poll, interval, url, timeout):
    g = first_missing(storage, gen_key)
    previous = _read_announcement(storage, g - 1, key)
    consumed: dict[str, list] = previous.get("joins", {}) if previous else {}
    watch = _DuplicateWatch(storage, previous, 0, key, interval)
    joins: dict[str, list] = {}
    problems: list[str] = []
    pending = list(range(1, world_size))
    backoff = Backoff(*poll)
    while pending:
        for r in list(pending):
            start = consumed.get(str(r), [-1])[0] + 1
            if not object_exists(storage, join_key(r, start)):
                continue
            latest = first_missing(storage, lambda n, r=r: join_key(r, n), start) - 1
            path = join_key(r, latest)
            record = decode_record(storage.read(path) or b"", key, path=storage.path_of(path),
                                   rank=0)
            joins[str(r)] = [latest, record.get("token")]
            theirs = record.get("settings", {})
            for name in sorted(set(settings) | set(theirs)):
                if settings.get(name) != theirs.get(name):
                    problems.append(
                        f"rank {r} has {name}={theirs.get(name)!r}, rank 0 has "
                        f"{settings.get(name)!r}"
                    )
            pending.remove(r)
        if not pending:
            break
        if time.monotonic() >= deadline:
            raise SyncTimeout(
                f"timed out after {timeout:g} s waiting for ranks {pending} to join",
                rank=0, path=url,
                hint="start every rank with the same URL and WORLD_SIZE "
                f"({world_size}); check their logs",
            )
        watch.poll()
        backoff.sleep(deadline)
    token = secrets.token_hex(8)
    record = {
        "generation": g,
        "token": token,
        "world_size": world_size,
        "settings": settings,
        "joins": joins,
        "error": "; ".join(problems) or None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "wall_time": time.time(),
    }
    storage.makedirs(gen_prefix(g, token))
    try:
        storage.put(gen_key(g), [encode_record(record, key)], exclusive=True)
    except FileExistsError:
        raise DuplicateRank(
            f"another rank 0 announced generation {g} at the same moment", rank=0,
            path=storage.path_of(gen_key(g)),
            hint="two jobs share this URL: stop one, or give each its own URL",
        ) from None
    if problems:
        raise ConfigError("ranks disagree on settings: " + record["error"], rank=0, path=url,
                          hint="start every rank with the same options and versions")
    return Generation(g, token, gen_prefix(g, token), settings)


def _join(storage, rank, world_size, settings, key, deadline, poll, interval, url, timeout):
    g = first_missing(storage, gen_key)  # announcements before this cannot include us
    attempt = first_missing(storage, lambda n: join_key(rank, n))
    token = secrets.token_hex(8)
    record = {
        "rank": rank,
        "world_size": world_size,
        "settings": settings,
        "token": token,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "wall_time": time.time(),
    }
    try:
        storage.put(join_key(rank, attempt), [encode_record(record, key)], exclusive=True)
    except FileExistsError:
        raise DuplicateRank(
            f"another process is joining as rank {rank} at the same moment", rank=rank,
            path=storage.path_of(join_key(rank, attempt)),
            hint="each process needs a distinct RANK; two jobs must not share one URL",
        ) from None
    watch = _DuplicateWatch(storage, _read_announcement(storage, g - 1, key), rank, key,
                            interval)
    backoff = Backoff(*poll)
    while True:
        raw = storage.read(gen_key(g))
        if raw is not None:
            announced = decode_record(raw, key, path=storage.path_of(gen_key(g)), rank=rank)
            mine = announced.get("joins", {}).get(str(rank))
            if mine == [attempt, token]:
                if announced.get("error"):
                    raise ConfigError(
                        "ranks disagree on settings: " + announced["error"], rank=rank,
                        path=url, hint="start every rank with the same options and versions",
                    )
                return Generation(g, announced["token"], gen_prefix(g, announced["token"]),
                                  announced["settings"])
            if mine is not None and mine[0] > attempt:
                raise DuplicateRank(
                    f"generation {g} took a later process as rank {rank} (attempt {mine[0]}, "
                    f"this process is attempt {attempt})", rank=rank,
                    path=storage.path_of(gen_key(g)),
                    hint="each process needs a distinct RANK; two jobs must not share one URL",
                )
            g += 1  # announced before our join became visible: not ours, look further
            continue
        if time.monotonic() >= deadline:
            raise SyncTimeout(
                f"timed out after {timeout:g} s waiting for rank 0 to announce "
                f"generation {g}",
                rank=rank, path=url,
                hint="is rank 0 running, with the same URL? (rank 0 waits for every rank "
                f"of WORLD_SIZE={world_size} to join)",
            )
        watch.poll()
        backoff.sleep(deadline)
